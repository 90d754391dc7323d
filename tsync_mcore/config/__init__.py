"""Typed configuration, loaded from configs/*.yaml and validated at start.

Every section is a dataclass. `load_config` walks the YAML mapping against the dataclass
fields, so a misspelt key or a value of the wrong type or outside its allowed set fails
immediately with a message naming the dotted key (e.g. `learner.k_open`). `resolve` then
turns every `auto` into a concrete, logged choice and refuses impossible combinations.
The comment on (or above) each field is its documentation: docs/guide/config.md is generated
from them (`python -m tsync_mcore.config --reference`).

checks      ConfigError and `check`, which names the dotted key of a failed condition
model       model (and model.lora)
learner     optim, learner
rollout     rollout
tasks       data, reward (and reward.judge), reasoning_gym, verifiers, tools
infra       run, publish, channel, launch
rules       Config (every section, and the rules across sections), resolve
load        YAML and --set overrides to a Config: coercion, renamed keys, load_config
reference   docs/guide/config.md, generated from the sections' field comments
"""

from tsync_mcore.config.checks import ConfigError
from tsync_mcore.config.infra import ChannelConfig, LaunchConfig, PublishConfig, RunConfig
from tsync_mcore.config.learner import (AccumDType, AccumPlacement, LearnerConfig, OptimConfig,
                                        Schedule, TokenNorm)
from tsync_mcore.config.load import (MAX_CONFIG_BYTES, RENAMED, from_dict, load_config,
                                     parse_overrides, to_dict)
from tsync_mcore.config.model import LORA_TARGETS, DType, LoraConfig, ModelConfig
from tsync_mcore.config.rollout import ENV_PREFIXES, RolloutConfig, RolloutDType
from tsync_mcore.config.rules import Config, resolve
from tsync_mcore.config.tasks import (JUDGE_TEMPLATE, DataConfig, JudgeConfig, ReasoningGymConfig,
                                      RewardConfig, ToolsConfig, VerifiersConfig)

__all__ = [
    "AccumDType", "AccumPlacement", "ChannelConfig", "Config", "ConfigError", "DType",
    "DataConfig", "ENV_PREFIXES", "JUDGE_TEMPLATE", "JudgeConfig", "LORA_TARGETS",
    "LaunchConfig", "LearnerConfig", "LoraConfig", "MAX_CONFIG_BYTES", "ModelConfig",
    "OptimConfig", "PublishConfig", "RENAMED", "ReasoningGymConfig", "RewardConfig",
    "RolloutConfig", "RolloutDType", "RunConfig", "Schedule", "TokenNorm", "ToolsConfig",
    "VerifiersConfig", "from_dict", "load_config", "parse_overrides", "resolve", "to_dict",
]
