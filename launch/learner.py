"""`torchrun --nproc-per-node N launch/learner.py --config C [--resume]`: a thin wrapper over tsync_mcore.cli.learner (also `tsync-learner` once installed)."""
from tsync_mcore.cli.learner import main

if __name__ == "__main__":
    main()
