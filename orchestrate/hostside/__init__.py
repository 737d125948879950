"""What runs on every host, with the standard library only (Python 3.8+, often ``python -S``).

The lowest layer: it imports nothing from orchestrate. The job tag and kill-by-tag, the lease
book, the port check (:mod:`.host`), the GPUs' use (:mod:`.gpuuse`) and the raw fact gatherer
(:mod:`.hostfacts`), which run and read ``nvidia-smi`` one way (:mod:`.smi`), and the way
programs are shipped to other machines as source text (:mod:`.shipping`; each program's owner
declares the modules it carries). Everything else of
orchestrate may import it; it is what the SSH agent, the Slurm monitor and the local watchdog
carry.
"""
