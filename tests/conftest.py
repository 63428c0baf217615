import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# the persistent cache would make later runs skip the compile paths under test; tests that need it
# point JNOVA_CACHE_DIR at their own temporary folder
os.environ["JNOVA_CACHE_DIR"] = "off"
