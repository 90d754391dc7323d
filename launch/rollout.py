"""`python launch/rollout.py --config C`: a thin wrapper over tsync_mcore.cli.rollout (also `tsync-rollout` once installed)."""
from tsync_mcore.cli.rollout import main

if __name__ == "__main__":
    main()
