"""Which cells of a student copy its test must run: the exercises and what they touch (tests/test_student.py).

A test helper, not part of the course: the student copy's test runs only these cells, since the demos left out run
exactly as in the worked notebook, whose own test runs them.
"""

from __future__ import annotations

from course_lib.classroom.student import _STUDENT_MARK, BEGIN, _source


def _free_reads(code: str) -> set[str]:
    """Names a cell reads from the notebook's namespace: at its top level, and inside its functions and classes
    the names that are neither their parameters nor their own variables (symtable's globals and frees)."""
    import symtable

    out, todo = set(), [symtable.symtable(code, "<cell>", "exec")]
    while todo:
        table = todo.pop()
        for sym in table.get_symbols():
            if sym.is_referenced() and (table.get_type() == "module" or sym.is_global() or sym.is_free()):
                out.add(sym.get_name())
        todo.extend(table.get_children())
    return out


def _names(source: str, modules: frozenset = frozenset()) -> tuple[set[str], set[str], bool]:
    """(names a cell binds or may change, names it reads, whether it runs a line magic such as %ranks start).

    IPython's own transformer turns magics into Python first. Changing an object counts as binding its name, so a
    cell that may change something a later cell reads is kept: x.append(...), x[i] = ..., x.attr = ..., and any
    call that is handed x (f(x) may change it in place); ``modules`` (names bound by imports) are read, not changed.
    """
    import ast

    from IPython.core.inputtransformer2 import TransformerManager

    code = TransformerManager().transform_cell(source)
    magic = "run_line_magic(" in code or "run_cell_magic(" in code   # %ranks ... and %%ranks: the ranks' state
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return set(), set(), magic
    bound, read = set(), set()

    def base(node):
        while isinstance(node, (ast.Attribute, ast.Subscript)):
            node = node.value
        return node.id if isinstance(node, ast.Name) else None

    def module_level(node):
        """The nodes of the cell's own scope: not inside a def, lambda, class or comprehension."""
        yield node
        for child in ast.iter_child_nodes(node):
            if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef,
                                      ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
                yield from module_level(child)

    read = _free_reads(code)
    for node in module_level(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            bound.add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.Attribute, ast.Subscript)) and isinstance(node.ctx, ast.Store):
            bound.add(base(node))
        elif isinstance(node, ast.Call):
            changed = [base(a) for a in [*node.args, *(k.value for k in node.keywords)]]
            if isinstance(node.func, ast.Attribute):
                changed.append(base(node.func.value))
            bound |= {n for n in changed if n and n not in modules}
    for node in tree.body:   # what a def or class statement itself binds
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
    return bound - {None}, read, magic


def cells_needed(nb: dict) -> list[int]:
    """Indices of the code cells that can behave differently in a student copy, and the cells they need (of a
    worked notebook or of its student copy).

    Kept: the first code cell (imports, and the folders later cells write into), every exercise cell (solution and
    check), every later cell that reads what a solution defines
    (transitively), every cell those cells read from (transitively), and magics (%ranks start, %%ranks: the ranks'
    state). Nothing after the last check cell. What is left out are demos that neither use an exercise nor feed
    one: they run exactly as in the worked notebook, whose own run tests them.
    """
    import ast

    cells = nb["cells"]
    code = [i for i, c in enumerate(cells) if c["cell_type"] == "code"]
    solutions = [i for i in code if BEGIN in _source(cells[i]) or _STUDENT_MARK in _source(cells[i])]
    if not solutions:
        return code
    checks = [next((k for k in code if k > i), i) for i in solutions]
    last = max(checks)
    modules: set[str] = set()
    for i in code:        # names bound by an import statement: a call on them changes nothing of the notebook's
        try:
            modules |= {(a.asname or a.name).split(".")[0] for n in ast.walk(ast.parse(_source(cells[i])))
                        if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names}
        except SyntaxError:
            pass
    info = {i: _names(_source(cells[i]), frozenset(modules)) for i in code if i <= last}
    keep = {code[0]} | set(solutions) | set(checks)   # a student copy, like the worked one, starts with its set-up
    tainted: set[str] = set()
    for i in sorted(info):                # forward: what the solutions define, and what is computed from it
        bound, read, _ = info[i]
        if i in solutions:
            tainted |= bound
        elif i > solutions[0] and read & tainted:
            keep.add(i)
            tainted |= bound
    wanted: set[str] = set()
    for i in sorted(info, reverse=True):  # backward: what the kept cells read, and what those read in turn
        bound, read, magic = info[i]
        if i not in keep and (magic or bound & wanted):
            keep.add(i)
        if i in keep:
            wanted |= read
    return sorted(keep)
