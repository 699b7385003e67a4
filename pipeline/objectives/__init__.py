"""Pretraining objectives: one module per objective (`mlm`, `mlm_nce`, `taco`, `capt`, `cocolm`,
`infoword`), the contract they implement (`base`), the registry the rest of the project uses
(`registry`) and the index sampling (`sampling`). The loss math as pure functions, the torch reference
of the Triton kernels, is `pipeline.kernels.functional`, one layer down.
"""
