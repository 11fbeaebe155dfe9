FROM python:3.11-slim

WORKDIR /app
COPY pyproject.toml README.md ./
COPY hermes_gateway ./hermes_gateway
COPY broker ./broker
COPY workers ./workers
COPY middleware ./middleware
RUN pip install --no-cache-dir .

# The example tools become the container's tool directory ($HERMES_HOME/tools).
ENV HERMES_HOME=/hermes
COPY examples/tools /hermes/tools

ENTRYPOINT ["hermes-gateway"]
CMD ["worker", "--queues", "tools,llm"]
