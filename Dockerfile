FROM python:3.11-slim

WORKDIR /app
COPY pyproject.toml README.md ./
COPY hermes_gateway ./hermes_gateway
COPY broker ./broker
COPY workers ./workers
COPY middleware ./middleware
RUN pip install --no-cache-dir '.[mcp]'

# Not root: a tool's command runs as this user. Its HERMES_HOME is its own (the run registry is written there).
RUN useradd --create-home --uid 10001 hermes && mkdir -p /hermes && chown hermes:hermes /hermes

# The example tools become the container's tool directory ($HERMES_HOME/tools).
ENV HERMES_HOME=/hermes
COPY --chown=hermes:hermes examples/tools /hermes/tools

USER hermes
ENTRYPOINT ["hermes-gateway"]
CMD ["worker", "--queues", "tools,llm"]
