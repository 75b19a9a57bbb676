"""The reference trainer: an ANDREA-style byte-level GPT that writes step_NNNNNN.bin files,
survives SIGTERM/SIGUSR1 and resumes bit-exactly (seed 000). Imports torch."""
