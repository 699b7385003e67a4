"""Pretraining objectives: one module per objective (`mlm`, `mlm_nce`, `taco`, `capt`, `cocolm`,
`infoword`), the contract they implement (`base`), the registry the rest of the project uses
(`registry`), the loss math as pure functions (`functional`, the torch reference of the Triton
kernels) and the index sampling (`sampling`).
"""
