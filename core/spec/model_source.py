"""What a `model.source` names: a builtin model, a local path, or a model on the Hugging Face Hub.

The rule, in order:
1. a builtin name (smollm2-135m-instruct, tiny-random) is that model;
2. a value starting with `/`, `.` or `~` is a local path;
3. `<org>/<name>` that is a valid Hub repository id (letters, digits, `-`, `_`, `.`; no `--`
   or `..`; at most 96 characters; not ending in `.git`: huggingface_hub's own check) is a
   Hub id;
4. anything else is a local path.

This is the spelling alone, the same on a laptop and in the operator. Where the model is loaded
(`asyncrl.model.hub.resolve`), a relative path that exists on that machine is a path even when
it is spelled like a Hub id: write `./org/name` to say so wherever it is read.
"""

from __future__ import annotations

import re

from asyncrl.spec.base import BUILTIN_MODELS

#: Prefixes that make a source a path whatever follows.
PATH_PREFIXES = ("/", ".", "~")


#: huggingface_hub's rule for a repository id (`huggingface_hub.utils.validate_repo_id`, its
#: REPO_ID_REGEX and the checks after it), written out here: the operator's image has no
#: huggingface_hub, and the operator must tell a Hub id as a laptop does.
#: tests/spec/test_spec_model_source.py holds the two to the same answers.
_REPO_ID = re.compile(r"(\b[\w\-.]{1,96}\b/)?\b[\w\-.]{1,96}\b", re.ASCII)


def hub_repo_id(source: str) -> str | None:
    """The Hub repository id `source` names by its spelling, or None (a builtin or a path)."""
    if source in BUILTIN_MODELS or source.startswith(PATH_PREFIXES) or source.count("/") != 1:
        return None
    if not _REPO_ID.fullmatch(source) or "--" in source or ".." in source or \
            source.endswith(".git"):
        return None
    return source
