"""lcjax.config.RunConfig's own defaults as a config file: what `--config.NAME=VALUE` overrides when no
--config is given (lcjax.cli.generate)."""
import dataclasses

import ml_collections

from lcjax.config import RunConfig


def get_config():
  return ml_collections.ConfigDict(dataclasses.asdict(RunConfig()))
