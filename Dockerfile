# kvviz in a container: the app on port 8501, with the default model fetched and converted at
# build time so the first run starts in seconds. The same image serves the OpenAI API on 8000:
#   docker run -p 8000:8000 kvviz python -m kvviz serve --host 0.0.0.0
FROM python:3.11-slim

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    KVVIZ_CACHE=/opt/kvviz-cache \
    PYTHONUNBUFFERED=1

WORKDIR /app
# llama-cpp-python is a source distribution: pip builds llama.cpp with cmake and a C++ compiler (minutes)
RUN apt-get update && apt-get install -y --no-install-recommends build-essential cmake \
    && rm -rf /var/lib/apt/lists/*
COPY requirements.txt .
# The runtime only: what requirements.txt lists under "# Tests" (pytest, a browser driver, pyspark) stays out.
RUN sed '/^# Tests/,$d' requirements.txt > /tmp/runtime.txt && pip install -r /tmp/runtime.txt

COPY . .
RUN python -m kvviz fetch-model smollm2

EXPOSE 8501 8000
HEALTHCHECK --interval=30s --timeout=5s CMD python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8501/_stcore/health')"
CMD ["streamlit", "run", "app.py", "--server.address=0.0.0.0", "--server.port=8501", \
     "--server.headless=true", "--browser.gatherUsageStats=false"]
