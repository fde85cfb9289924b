"""What every part of the RLJob spec shares: the API names, naming limits, the base model
(camelCase keys, unknown keys refused) and `rule_error` for rules pydantic cannot state."""

from __future__ import annotations


from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel
from pydantic_core import PydanticCustomError


GROUP = "asyncrl.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "RLJob"
PLURAL = "rljobs"
SINGULAR = "rljob"

#: Model names `model.source` resolves without a path.
BUILTIN_MODELS = ("smollm2-135m-instruct", "tiny-random")

#: Child objects are named `<job name>-<component>` (e.g. `<name>-trainer`, a StatefulSet whose
#: pods carry a 63-character revision label), so the job name is kept well below 63 characters.
MAX_NAME_LENGTH = 40
NAME_PATTERN = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"

#: The resource-name Kubernetes uses for NVIDIA GPUs; `placement.gpus` requests it.
GPU_RESOURCE = "nvidia.com/gpu"

RULE_ERROR = "asyncrl_rule"


def rule_error(message: str, *, fix: str, field: str = "") -> PydanticCustomError:
    """An error for a rule pydantic cannot state by itself.

    `field` is the camelCase path of the offending field relative to the model that raises
    (e.g. "placement.gpus"); `fix` says what to change. Neither may contain braces.
    """
    return PydanticCustomError(RULE_ERROR, message, {"fix": fix, "field": field})


class SpecModel(BaseModel):
    """Shared base: camelCase keys in YAML, unknown keys are errors."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
    )
