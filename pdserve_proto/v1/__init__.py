"""Generated at build time (setup.py); only this file is kept in git."""
