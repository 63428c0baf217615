"""nova -> nova passes. Each logs a summary line at DEBUG on the `jnova.passes` logger and each single
rewrite (a canonicalization, a merged repeat, a refused fusion) at TRACE, below DEBUG: JNOVA_LOG=DEBUG
prints the stages' times and the passes' summaries, JNOVA_LOG=TRACE every rewrite too."""
import logging

TRACE = 5
logging.addLevelName(TRACE, "TRACE")
