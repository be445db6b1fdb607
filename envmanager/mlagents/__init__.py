"""ML-Agents backend for envmanager (optional extra: ``pip install envmanager[mlagents]``)."""
