"""What the ``slide`` command shows while it trains, where Lightning's defaults read as bugs: the progress bar of a
run bounded by ``max_steps`` (Lightning's says "Epoch 1/-2", and ``v_num: 0.000`` for the log version) and a model
summary without a FLOPs column (Lightning's counts FLOPs only from an ``example_input_array`` and prints 0)."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import ModelSummary, ProgressBar, RichModelSummary, RichProgressBar, TQDMProgressBar
from lightning.pytorch.utilities import rank_zero_info


def count_text(n: int) -> str:
    """A parameter count as people write it: 793 K, 124 M, 8.03 B."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}" if n < 100 * size else f"{n / size:.0f} {unit}"
    return str(n)


class _Bar:
    def get_metrics(self, trainer, module) -> dict[str, Any]:
        metrics = super().get_metrics(trainer, module)
        metrics.pop("v_num", None)  # the log directory's version, not a training figure
        return metrics

    def _get_train_description(self, current_epoch: int) -> str:  # RichProgressBar's
        if self.trainer.max_epochs is None or self.trainer.max_epochs < 0:  # -1: bounded by max_steps only
            return f"Epoch {current_epoch}"
        return super()._get_train_description(current_epoch)


class SlideRichProgressBar(_Bar, RichProgressBar):
    """Lightning's rich progress bar, without the epoch count of an epoch-less run and the log version."""


class SlideTQDMProgressBar(_Bar, TQDMProgressBar):
    """Lightning's tqdm progress bar, without the log version."""


class SlideModelSummary(ModelSummary):
    """Lightning's model summary, without FLOPs (never counted here) and with counts in K, M and B."""

    @staticmethod
    def summarize(summary_data, total_parameters, trainable_parameters, model_size, total_training_modes,
                  total_flops, **kwargs) -> None:  # fmt: skip
        columns = [(name, values) for name, values in summary_data if name != "FLOPs"]
        widths = [max(len(name), *(len(v) for v in values)) for name, values in columns]
        rows = [[name for name, _ in columns], *zip(*(values for _, values in columns))]
        lines = ["  ".join(f"{cell:<{w}}" for cell, w in zip(row, widths)).rstrip() for row in rows]
        lines.insert(1, "-" * len(lines[0]))
        lines += [
            f"{count_text(trainable_parameters)} trainable, {count_text(total_parameters - trainable_parameters)}"
            f" frozen, {count_text(total_parameters)} parameters ({model_size:.1f} MB)",
        ]
        rank_zero_info("\n".join(lines))


def use_slide_display(trainer, configured: list) -> None:
    """Put the displays above in place of the progress bar and model summary Lightning added by default (none of a
    kind the user ``configured`` among the callbacks is replaced)."""
    for i, callback in enumerate(trainer.callbacks):
        if any(isinstance(c, (ProgressBar, ModelSummary)) and isinstance(callback, type(c)) for c in configured):
            continue
        if type(callback) is RichProgressBar:
            trainer.callbacks[i] = SlideRichProgressBar()
        elif type(callback) is TQDMProgressBar:
            trainer.callbacks[i] = SlideTQDMProgressBar()
        elif type(callback) in (ModelSummary, RichModelSummary):
            trainer.callbacks[i] = SlideModelSummary(max_depth=callback._max_depth)
