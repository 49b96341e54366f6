"""What ``lightning_bamboo`` and ``lightning_dorylus`` share, and nothing else: the tensor codec every process
boundary of both packages speaks (:mod:`lbd_common.codec`), the no-pickle broadcast of small values both
strategies' ``broadcast`` use (:mod:`lbd_common.broadcast`), the filter for a Lightning warning users cannot
act on (:mod:`lbd_common._warnings`) and the preload fork server (:mod:`lbd_common.preload`: Bamboo's agents
fork their workers from it; both packages' test suites start their processes from it).

A package of its own because neither strategy package may import the other: importing either registers its
strategy with Lightning and loads all of it. It stays small (torch and the standard library only); anything
that belongs to one strategy lives in that strategy's package.
"""
