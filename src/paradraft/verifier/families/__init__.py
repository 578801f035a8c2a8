"""One file per verifier family the fast runner implements; each registers its adapter (adapters.register)."""
