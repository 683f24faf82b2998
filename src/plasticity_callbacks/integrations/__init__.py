"""Adapters that run the package's Lightning callbacks inside other training loops (Hugging Face ``Trainer``)."""
