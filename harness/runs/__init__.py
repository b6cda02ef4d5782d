"""Stage 6, the stored run and what reads it: the run directory, summary, HTML report, compare, export.

May import: every earlier stage; reads only run directories, never live models.
"""
