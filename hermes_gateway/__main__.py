"""``python -m hermes_gateway``: the ``hermes-gateway`` command, for when the script is not on PATH."""

from hermes_gateway.cli import main

if __name__ == "__main__":
    main(prog_name="hermes-gateway")
