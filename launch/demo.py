"""`make demo`: a thin wrapper over tsync_mcore.cli.demo (also `tsync-demo` once installed)."""
from tsync_mcore.cli.demo import main

if __name__ == "__main__":
    main()
