"""The host modules import in one direction (DESIGN.md "Host modules"): every import of a cuflash
module, at module level or inside a function, goes to a strictly lower layer, so there is no cycle.
Read from the source with ast; no module is imported."""
import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "cuflash"

# module -> layer; a module may import only modules of lower layers
LAYERS = {
    "_config": 0, "_broadcast": 0, "_memo": 0,    # the leaves
    "_modifiers": 0,                              # (the score transforms' table)
    "_dropout": 0,                                # (dropout's Philox bits on the host)
    "_validate": 1,                               # the Problem
    "_runtime": 2, "_tma": 2,                     # below the CUDA paths
    "_numpy": 2, "reference": 2,                  # the CPU path
    "_generic": 3, "_decode": 3,                  # the CUDA paths, generic first: the tensor-core
    "_mask_tiles": 3,                             # (a service of the paths below)
    "_sinks": 3,                                  # (the sinks' join and gradient, for api)
    "_mma_fwd": 4, "_wide": 4,                # paths launch its lost-row kernels, and the
    "_paged": 4,                                  # (paged KV: decode reads pages, else gathers)
    "_varlen": 3,                                 # (packed sequences: padded, then any path)
    "_mma_bwd": 5, "_wgmma_fwd": 5,               # backward reads the forward's layout rule
    "_gpu": 6,                                    # the dispatcher and the catalog
    "api": 7,
    "ring": 8,                                    # context parallelism, on the public functions
    "__init__": 9,
}
PATHS = ("_generic", "_mma_fwd", "_wgmma_fwd", "_wide", "_mma_bwd", "_decode")


def _imports(path):
    """The cuflash modules a file imports, anywhere in it."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1 and node.module:  # from .x import y
                found.add(node.module)
            elif node.level == 1 or node.module == "cuflash":  # from . import x
                found |= {a.name for a in node.names}
            elif node.module and node.module.startswith("cuflash."):
                found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[1] for a in node.names if a.name.startswith("cuflash.")}
    return found


GRAPH = {p.stem: _imports(p) for p in sorted(PKG.glob("*.py"))}


def test_every_module_has_a_layer():
    assert set(GRAPH) == set(LAYERS), "place new modules in LAYERS"
    for targets in GRAPH.values():
        assert targets <= set(GRAPH), targets


@pytest.mark.parametrize("module", sorted(GRAPH))
def test_imports_go_down(module):
    upward = {t for t in GRAPH[module] if LAYERS[t] >= LAYERS[module]}
    assert not upward, f"cuflash.{module} imports {sorted(upward)}, not below it"


def test_no_cycle():
    done, active = set(), []

    def visit(m):
        assert m not in active, "import cycle: " + " -> ".join(active[active.index(m):] + [m])
        if m not in done:
            active.append(m)
            for t in GRAPH[m]:
                visit(t)
            active.pop()
            done.add(m)

    for m in GRAPH:
        visit(m)


def test_paths_share_one_interface():
    """Forward paths: NAME, takes, forward; backward paths: NAME, takes_backward, backward; each
    lists its kernels (instantiations) for the catalog."""
    import cuflash._gpu as gpu

    for path in gpu.PATHS:
        assert path.__name__.rsplit(".", 1)[1] in PATHS and callable(path.instantiations)
    for path in gpu.FORWARD:
        assert callable(path.takes) and callable(path.forward) and path.NAME
        assert isinstance(path.SINKS, bool)  # whether its kernels join attention sinks
    for path in gpu.BACKWARD:
        assert callable(path.takes_backward) and callable(path.backward) and path.NAME
    assert [p.NAME for p in gpu.FORWARD] == ["split", "wgmma", "mma", "wide", "generic"]
    assert [p.NAME for p in gpu.BACKWARD] == ["mma", "wide", "generic"]


def test_override_sets_only_what_it_names_and_restores():
    from cuflash import _gpu, _runtime

    default = _runtime.overrides()
    with _gpu.override(poison=True):
        with _gpu.override(path="split-simt"):
            assert _runtime.overrides() == default._replace(poison=True, path="split",
                                                            variant="simt")
        assert _runtime.overrides() == default._replace(poison=True)
    assert _runtime.overrides() == default
    with pytest.raises(ValueError, match="path must be one of"):
        with _gpu.override(path="sm80"):
            pass
    assert _runtime.overrides() == default
