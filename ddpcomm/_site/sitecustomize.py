"""Started in every Python process under ``python -m ddpcomm.run`` (it is on PYTHONPATH).

It imports nothing heavy: it waits for ``torch.nn.parallel.distributed`` to be imported
(during ``import torch``) and wraps ``DistributedDataParallel.__init__`` so that each new
DDP model is handed to ``ddpcomm.autohook.attach``; ddpcomm itself is imported at the
first DDP model, once torch is complete. Then it runs the ``sitecustomize`` this one
shadows, if the environment has one.
"""

import importlib.abc
import importlib.util
import os
import sys

_WATCHED = "torch.nn.parallel.distributed"


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != _WATCHED:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_wrap(module):
            exec_module(module)
            ddp = module.DistributedDataParallel
            init = ddp.__init__

            def __init__(self, *args, **kwargs):
                init(self, *args, **kwargs)
                from ddpcomm import autohook

                autohook.attach(self)

            ddp.__init__ = __init__

        spec.loader.exec_module = exec_then_wrap
        return spec


sys.meta_path.insert(0, _Finder())


def _chain() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        candidate = os.path.join(os.path.abspath(entry or os.curdir), "sitecustomize.py")
        if os.path.dirname(candidate) != here and os.path.isfile(candidate):
            with open(candidate) as f:
                code = compile(f.read(), candidate, "exec")
            exec(code, {"__name__": "sitecustomize", "__file__": candidate})
            return


_chain()
