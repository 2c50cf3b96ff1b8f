# One image for every role (web, workers, Flower); docker-compose.yml picks the command.
FROM python:3.11-slim

# DJANGO_SETTINGS_MODULE: the production profile unless a deployment says otherwise (it refuses to start
# without a secret key, where the local profile would make one up).
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    PLATFORM_VAR_DIR=/app/var \
    DJANGO_SETTINGS_MODULE=platform_.settings.production

# Empty: torch==2.13.0 from PyPI, which on Linux x86_64 is the CUDA build (for GPU hosts).
# For a CPU-only image pass PyTorch's CPU wheel index, e.g.
#   docker compose build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG TORCH_INDEX_URL=""

WORKDIR /app
COPY requirements.txt .
RUN pip install --no-cache-dir --upgrade pip \
 && if [ -n "$TORCH_INDEX_URL" ]; then pip install --no-cache-dir --index-url "$TORCH_INDEX_URL" torch==2.13.0; fi \
 && pip install --no-cache-dir -r requirements.txt

COPY . .
RUN useradd --create-home app && mkdir -p /app/var && chown -R app /app/var
USER app
EXPOSE 8000 5555
CMD ["python", "-m", "platform_.server", "--host", "0.0.0.0", "--port", "8000", "--workers", "2"]
