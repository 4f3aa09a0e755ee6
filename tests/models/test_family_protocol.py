"""Family adapters are found by the protocols of kvstate.models.family, not by probing one name."""

from types import ModuleType, SimpleNamespace

import pytest

from kvstate.errors import KvstateError
from kvstate.families import adapter, supported_model_types
from kvstate.models import loader
from kvstate.models.family import FamilyAdapter, RunnableFamily


def test_every_family_module_is_an_adapter_and_the_runnable_ones_load():
    for model_type in supported_model_types():
        family = adapter(model_type)
        assert isinstance(family, FamilyAdapter), model_type
        assert model_type in family.MODEL_TYPES
    assert isinstance(adapter("qwen3_5"), RunnableFamily)


@pytest.mark.parametrize("missing", ["model_options", "weight_targets"])
def test_a_family_missing_any_runnable_method_is_planned_only(monkeypatch, missing):
    """Every method RunnableFamily names is needed (the old check asked for weight_targets alone)."""
    module = ModuleType("half_family")
    module.MODEL_TYPES, module.read = ("half",), lambda cfg, name: None
    module.model_options = module.weight_targets = lambda *a: None
    delattr(module, missing)
    monkeypatch.setattr(loader, "adapter", lambda model_type: module)
    with pytest.raises(KvstateError, match="can be planned but not run"):
        loader.family_of(SimpleNamespace(model_type="half", source="x", name="x"))
    module.__dict__[missing] = lambda *a: None
    assert loader.family_of(SimpleNamespace(model_type="half", source="x", name="x")) is module
