"""A run's own machinery: verified checkpoints (files and FSDP2 folders), the resume guard and run lock,
and the logs a resumed run continues. Used by the Hydra app; the callbacks do not import it."""
