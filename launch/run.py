"""`python launch/run.py --config C [--set K=V ...] [--resume]`: a thin wrapper over tsync_mcore.cli.run (also `tsync-run` once installed)."""
from tsync_mcore.cli.run import main

if __name__ == "__main__":
    main()
