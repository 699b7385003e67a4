"""Pretraining objectives: one module per objective (`mlm`, `mlm_nce`, `taco`, `capt`, `cocolm`, `electra`,
`infoword`), the contract they implement (`base`), the registry the rest of the project uses
(`registry`), the index sampling (`sampling`) and the auxiliary generator ELECTRA and COCO-LM share
(`replaced_tokens`). The loss math as pure functions, the torch reference
of the Triton kernels, is `pipeline.kernels.functional`, one layer down.
"""
