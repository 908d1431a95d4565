# Sphinx configuration of the docs site. The pages are nbdev's processed notebooks (_proc/), rendered by myst-nb
# without re-running them; tools/build_docs.py prepares them and runs Sphinx.
import configparser, pathlib

_ini = configparser.ConfigParser(delimiters=['='])
_ini.read(pathlib.Path(__file__).resolve().parent.parent / 'settings.ini')
_cfg = _ini['DEFAULT']

project = _cfg['lib_name']
author = _cfg['author']
copyright = _cfg['copyright']
release = _cfg['version']
extensions = ['myst_nb']
root_doc = 'index'
exclude_patterns = ['_build', '**.ipynb_checkpoints', 'sidebar.yml', '_quarto.yml']
nb_execution_mode = 'off'          # the notebooks' own outputs are shown; nbdev_test runs them
nb_output_stderr = 'remove'
myst_enable_extensions = ['colon_fence', 'dollarmath']
html_theme = 'furo'
html_title = f"{project} {release}"
suppress_warnings = ['mystnb.unknown_mime_type', 'misc.highlighting_failure']
myst_all_links_external = True   # nbdev's links to symbols are plain relative URLs ('core.html#trainer')
