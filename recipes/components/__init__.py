"""Small example models and data modules that recipes combine (the libraries ship the real components)."""
