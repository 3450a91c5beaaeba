"""``python -m cupyep.launcher -n N [options] script.py ...``: cupyep.launcher.launch."""
import sys

from .launch import main

sys.exit(main())
