"""Which training prompt a prompt cursor names: the one owner of that rule.

The buffer hands out cursors 0, 1, 2, ... with the slots it grants (asyncrl.buffer.scripts),
each once across every rollout replica and restart, and again only when the slot that had it
was lost. Over N training prompts, cursor c is position c % N of epoch c // N, and each epoch
visits the prompts in an order of its own: a permutation seeded by (dataset.seed, epoch). So
every worker maps a cursor to the same prompt without talking to the others, and a job run
again visits its prompts in the same orders.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # the buffer reads epochs here without importing the prompt builders
    from asyncrl.data.prompts import PromptItem, PromptSet

#: numpy seeds are non-negative; a negative dataset.seed is taken modulo 2**64.
_SEED_BITS = (1 << 64) - 1


def epoch_of(cursor: int, prompts: int) -> int:
    """The epoch (from 0) of `cursor` over `prompts` training prompts; 0 while N is unknown."""
    return cursor // prompts if prompts > 0 else 0


class PromptOrder:
    """The prompts of `prompts` by cursor, in a seeded order per epoch."""

    def __init__(self, prompts: PromptSet, seed: int):
        if len(prompts) == 0:
            raise ValueError("the job has no training prompts: check dataset (numPrompts, "
                             "evalFraction, path) and dataset.maxPromptTokens")
        self.prompts = prompts
        self.seed = seed
        # The orders in use: an epoch's, and the one before it while lost slots of that
        # epoch are still being handed out again. N positions each: kept only that long.
        self._orders: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return len(self.prompts)

    def order(self, epoch: int) -> np.ndarray:
        """Epoch `epoch`'s permutation of the prompt indices."""
        order = self._orders.get(epoch)
        if order is None:
            order = np.random.default_rng([self.seed & _SEED_BITS, epoch]).permutation(len(self))
            self._orders[epoch] = order
            for old in sorted(self._orders)[:-2]:
                del self._orders[old]
        return order

    def index(self, cursor: int) -> int:
        """The index into the prompt set of the prompt `cursor` names."""
        if cursor < 0:
            raise ValueError(f"prompt cursor {cursor} is negative")
        epoch, position = divmod(cursor, len(self))
        return int(self.order(epoch)[position])

    def item(self, cursor: int) -> PromptItem:
        return self.prompts[self.index(cursor)]

    def fits(self, item: PromptItem) -> bool:
        """Whether the job runs `item` (not longer than dataset.maxPromptTokens)."""
        return self.prompts.fits(item)
