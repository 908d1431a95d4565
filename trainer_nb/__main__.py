__all__ = []

# %% ../nbs/10_cli.ipynb #635fbf08
#| eval: false
import sys
from .cli import main

if __name__ == '__main__': sys.exit(main())

# %% ../nbs/10_cli.ipynb #635fbf08
#| eval: false
import sys
from .cli import main

if __name__ == '__main__': sys.exit(main())

# %% ../nbs/10_cli.ipynb #635fbf08
#| eval: false
import sys
from .cli import main

if __name__ == '__main__': sys.exit(main())

# %% ../nbs/10_cli.ipynb #635fbf08
#| eval: false
import sys
from .cli import main

if __name__ == '__main__': sys.exit(main())

# %% ../nbs/10_cli.ipynb #635fbf08
#| eval: false
import sys
from .cli import main

if __name__ == '__main__': sys.exit(main())

# %% ../nbs/10_cli.ipynb #635fbf08
#| eval: false
import sys
from .cli import main

if __name__ == '__main__': sys.exit(main())

# %% ../nbs/10_cli.ipynb #635fbf08
#| eval: false
import sys
from .cli import main

if __name__ == '__main__': sys.exit(main())

# %% ../nbs/10_cli.ipynb #635fbf08
#| eval: false
import sys
from .cli import main

if __name__ == '__main__': sys.exit(main())

# %% ../nbs/10_cli.ipynb #635fbf08
#| eval: false
import sys
from .cli import main

if __name__ == '__main__': sys.exit(main())

# %% ../nbs/10_cli.ipynb #635fbf08
#| eval: false
import sys
from .cli import main

if __name__ == '__main__': sys.exit(main())

# %% ../nbs/10_cli.ipynb #635fbf08
#| eval: false
import sys
from .cli import main

if __name__ == '__main__': sys.exit(main())

# %% ../nbs/10_cli.ipynb #635fbf08
#| eval: false
import sys
from .cli import main

if __name__ == '__main__': sys.exit(main())