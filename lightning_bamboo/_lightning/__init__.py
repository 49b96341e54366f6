"""Where Bamboo meets Lightning: the private names it pins (with the test that fails when
Lightning changes them), the one seam into the user's module, the named precision plugins and the
launcher of a plain ``python train.py``.
"""
