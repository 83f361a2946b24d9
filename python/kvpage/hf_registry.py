"""`import kvpage` is enough for transformers' `attn_implementation="kvpage"` (from_pretrained, from_config,
set_attn_implementation), while importing neither torch nor transformers itself (kvpage.core and
`kvpage plan` stay light).

transformers checks the name against its attention registry (AttentionInterface, in
transformers.modeling_utils) and builds masks through AttentionMaskInterface (transformers.masking_utils).
"kvpage" is registered in each as that module finishes importing: at once where it already has,
otherwise by a meta-path finder that wraps those two modules' loaders (a post-import hook, as wrapt's).
What is registered are stand-ins that import kvpage.model.attention on their first call; that import
registers the real functions in their place (attention.register).
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

ATTN_IMPLEMENTATION = "kvpage"


def _attention(*args, **kwargs):
    from kvpage.model.attention import kvpage_attention_forward

    return kvpage_attention_forward(*args, **kwargs)


def _mask(*args, **kwargs):
    from kvpage.model.attention import padding_mask

    return padding_mask(*args, **kwargs)


def _register_attention(modeling_utils) -> None:
    modeling_utils.AttentionInterface.register(ATTN_IMPLEMENTATION, _attention)


def _register_mask(masking_utils) -> None:
    masking_utils.AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _mask)


# module -> what to do with it once it has executed
_PENDING = {"transformers.modeling_utils": _register_attention, "transformers.masking_utils": _register_mask}


class _ThenRegister(importlib.abc.Loader):
    """The module's own loader, then the registration."""

    def __init__(self, loader, register) -> None:
        self.loader, self.register = loader, register

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        self.loader.exec_module(module)
        self.register(module)

    def __getattr__(self, name):  # get_source, get_resource_reader, ...: the module's own loader's
        return getattr(self.loader, name)


class _RegisterOnImport(importlib.abc.MetaPathFinder):
    """Finds transformers' two registry modules as the path finder would, with _ThenRegister loaders."""

    def find_spec(self, fullname, path, target=None):
        register = _PENDING.pop(fullname, None)
        if register is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _ThenRegister(spec.loader, register)
        return spec


def install() -> None:
    """Register now in the registry modules already imported; hook the others' import."""
    for name in [n for n in _PENDING if n in sys.modules]:
        _PENDING.pop(name)(sys.modules[name])
    if _PENDING and not any(isinstance(f, _RegisterOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterOnImport())
