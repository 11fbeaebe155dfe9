"""Running calls: worker processes on RQ, the call state machine, policy, retries/breakers, executors.

The middleware package reads config.yaml with the gateway's YAML reader, so the seed's unquoted
``{{field}}`` templates there do not break plugin loading.
"""

from broker.yamlload import load_yaml
from middleware import set_config_loader

set_config_loader(load_yaml)
