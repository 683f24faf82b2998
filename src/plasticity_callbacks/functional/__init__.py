"""The math of every technique as plain functions over tensors; nothing here imports Lightning.

- :mod:`.spectral`: polar factor (orthogonalization), deviation from isometry, spectra (FIRE).
- :mod:`.isometry`: FIRE on one weight (per-tap conv scaling, target scale), its options and record.
- :mod:`.dormancy`: dormancy scores and neuron recycling (ReDo).
- :mod:`.shrink`: direction-aware shrink factors (DASH) and ``shrink_perturb_`` (Shrink & Perturb).
- :mod:`.subspace`: successive-SVD metrics and the full/minor decision (AdaptiveSVDSwitch).
"""
