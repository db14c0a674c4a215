"""How much config text Muster takes (see shared/loader.py): here, below both shared/loader.py
and shared/yamlload.py, so the YAML reader can apply them without importing the loader that
imports it (shared/loader.py re-exports them)."""

MAX_CONFIG_BYTES = 1024 * 1024
MAX_YAML_ALIASES = 100
