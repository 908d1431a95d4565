# Sphinx configuration of the docs site. The pages are nbdev's processed notebooks (_proc/), executed by
# tools/build_docs.py (which prepares them and runs Sphinx); myst-nb renders them with their outputs as they are.
# The site loads nothing from the network: math is MathML written at build time, widgets show their static form.
import configparser, pathlib

_ini = configparser.ConfigParser(delimiters=['='])
_ini.read(pathlib.Path(__file__).resolve().parent.parent / 'settings.ini')
_cfg = _ini['DEFAULT']

project = _cfg['lib_name']
author = _cfg['author']
copyright = _cfg['copyright']
release = _cfg['version']
extensions = ['myst_nb', 'sphinx_copybutton']
root_doc = 'index'
exclude_patterns = ['_build', '**.ipynb_checkpoints', 'sidebar.yml', '_quarto.yml']
nb_execution_mode = 'off'          # tools/build_docs.py has run the notebooks already
nb_output_stderr = 'remove'
nb_render_markdown_format = 'gfm'   # markdown outputs (show_doc's) with tables: the parameter tables
# a widget view needs the widget manager's JavaScript from a CDN: show the static form the output also carries
nb_mime_priority_overrides = [('html', 'application/vnd.jupyter.widget-view+json', None)]
myst_enable_extensions = ['colon_fence', 'dollarmath']
html_theme = 'furo'
html_title = f"{project} {release}"
html_static_path = ['_static']
html_css_files = ['custom.css']   # a wider column for code, tables and images that fit a phone (see the file)
html_math_renderer = 'mathml'
suppress_warnings = ['mystnb.unknown_mime_type', 'misc.highlighting_failure']
myst_all_links_external = True   # nbdev's links to symbols are plain relative URLs ('core.html#trainer')
copybutton_exclude = '.linenos, .gp, .go'   # copy the code, not prompts or output


# ---- math as MathML: rendered by the browser itself, with no script (MathJax would come from a CDN) ----

def _mathml(latex: str, display: bool) -> str:
    from latex2mathml.converter import convert
    return convert(latex.strip(), display='block' if display else 'inline')

def _visit_math(self, node):
    self.body.append(_mathml(node.astext(), display=False))
    from docutils import nodes
    raise nodes.SkipNode

def _visit_math_block(self, node):
    from docutils import nodes
    self.body.append(self.starttag(node, 'div', CLASS='math'))
    for part in (p for p in node.astext().split('\n\n') if p.strip()):
        self.body.append(_mathml(part, display=True))
    self.body.append('</div>\n')
    raise nodes.SkipNode

def setup(app):
    app.add_html_math_renderer('mathml', (_visit_math, None), (_visit_math_block, None))
