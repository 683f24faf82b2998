"""A method applied to a model and its optimizer state, as plain functions: no Lightning, no schedule.

The callbacks decide *when*; these do *what*, on any ``nn.Module`` the model map understands.
"""
