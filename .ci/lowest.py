"""Print a pip constraints file that pins every dependency of numcoll (and of
the extras named on the command line) to the lowest release pyproject.toml
allows: `name>=X` becomes `name==X`. CI's second lane installs with it, so
the lower bounds we publish are ones that were tested."""

import re
import sys
import tomllib
from pathlib import Path

project = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml")
                        .read_text())["project"]
requirements = list(project["dependencies"])
for extra in sys.argv[1:]:
    requirements += project["optional-dependencies"][extra]
for requirement in requirements:
    match = re.match(r"^([A-Za-z0-9_.\-]+)\s*>=\s*([^,;\s]+)", requirement)
    if match:
        print(f"{match[1]}=={match[2]}")
