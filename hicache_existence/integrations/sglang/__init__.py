"""The SGLang integration: plugin, hooks, server flags and the fallback launcher
(docs/enable.md; the modules are listed in CONTRIBUTING.md).

The only code of the package that imports sglang (always lazily, inside a
function, guarded): importing this sub-package costs nothing and never imports
sglang or torch.
"""
