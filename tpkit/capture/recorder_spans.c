/* The Recorder's enter and exit in C: a span opened and closed at every phase boundary of the
 * loop's step (a dozen a step), with no Python frame of tpkit's.
 *
 * Why and how: recorder.py (``Recorder.enter`` / ``Recorder.exit`` are the Python the two
 * methods here do, line for line; ``use_c_spans`` puts these in their place). Each is a method
 * descriptor of the Recorder class, made by ``methods(Recorder, python_enter, python_exit)``:
 * ``rec.enter("forward", "GPT2")`` calls ``span_enter`` with the recorder first. Where a
 * recorder's state is not what the Python writes (its tables replaced by other types, a token
 * that is not an int), the call goes to the Python method instead, before doing anything: the
 * two never differ in what they record.
 *
 * Every record is appended value by value without running Python code in between (no object
 * the garbage collector tracks is made for it), so another thread's snapshot under the GIL sees
 * whole records, as with the Python's one list extend. The clock is time.perf_counter_ns's, or
 * what recorder.py's perf_counter_ns is where a test replaced it (read_clock).
 *
 * Only plain CPython API: no torch header (native.py builds it in well under a second). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

static PyObject *python_enter = NULL; /* Recorder.enter as Python: the fallback */
static PyObject *python_exit = NULL;
static PyObject *s_open, *s_cuda_timer, *s_phase_listeners, *s_stack, *s_spans, *s_step_index,
    *s_own_host_ns, *s_mark, *s_perf_counter_ns, *s_tpkit, *s_probes, *s_enter, *s_exit, *s_user, *s_phase, *s_source;

/* time.perf_counter_ns(), as the recorder module calls it: its own clock, unless that name in
 * the module's dict is something else now (a test's fake clock): then that. */
static PyObject *module_dict = NULL; /* recorder.py's globals */
static PyObject *real_clock = NULL;  /* time.perf_counter_ns */
static PyObject *clock_now = NULL;   /* what the module calls now, where not real_clock */

static void read_clock(void) {
    PyObject *c = module_dict == NULL ? NULL : PyDict_GetItemWithError(module_dict, s_perf_counter_ns);
    if (c == NULL) PyErr_Clear();
    if (c == real_clock) c = NULL;
    Py_XINCREF(c);
    Py_XSETREF(clock_now, c);
}

static long long now_ns(void) {
    if (clock_now != NULL) {
        PyObject *v = PyObject_CallNoArgs(clock_now);
        long long t = v == NULL ? -1 : PyLong_AsLongLong(v);
        Py_XDECREF(v);
        if (t != -1 || !PyErr_Occurred()) return t;
        PyErr_WriteUnraisable(clock_now); /* (a fake clock that failed: the real one) */
    }
#if PY_VERSION_HEX >= 0x030D0000
    PyTime_t t;
    if (PyTime_PerfCounterRaw(&t) < 0) return 0;
    return (long long)t;
#else
    return (long long)_PyTime_GetPerfCounter();
#endif
}

/* timer.mark(), or None where there is no timer (a new reference; NULL on error). */
static PyObject *mark(PyObject *timer) {
    if (timer == Py_None) Py_RETURN_NONE;
    Py_INCREF(timer); /* (its mark is Python: the recorder may let go of it meanwhile) */
    PyObject *out = PyObject_CallMethodNoArgs(timer, s_mark);
    Py_DECREF(timer);
    return out;
}

/* list.append of `n` values, the references stolen (each may be NULL: an error, after which
 * the rest are released and -1 returned). */
static int append_stolen(PyObject *list, PyObject **values, int n) {
    int failed = 0;
    for (int i = 0; i < n; i++) {
        if (!failed && (values[i] == NULL || PyList_Append(list, values[i]) < 0)) failed = 1;
        Py_XDECREF(values[i]);
    }
    return failed ? -1 : 0;
}

/* What enter and exit read of a recorder, borrowed from its __dict__ (read where the Python
 * reads self.<name>: again after any Python code ran, a listener or a CUDA timer's mark). */
typedef struct {
    PyObject *open;      /* dict: phase -> spans of it open */
    PyObject *timer;     /* cuda_timer, or None */
    PyObject *listeners; /* list */
    PyObject *stack;     /* list */
    PyObject *spans;     /* list */
} Fields;

/* 0: read; 1: not what the Python writes (a name missing or of another type: no error set);
 * -1: an error. */
static int read_fields(PyObject *d, Fields *f) {
    f->open = PyDict_GetItemWithError(d, s_open);
    f->timer = f->open == NULL ? NULL : PyDict_GetItemWithError(d, s_cuda_timer);
    f->listeners = f->timer == NULL ? NULL : PyDict_GetItemWithError(d, s_phase_listeners);
    f->stack = f->listeners == NULL ? NULL : PyDict_GetItemWithError(d, s_stack);
    f->spans = f->stack == NULL ? NULL : PyDict_GetItemWithError(d, s_spans);
    if (f->spans == NULL) return PyErr_Occurred() ? -1 : 1;
    if (!PyDict_CheckExact(f->open) || !PyList_CheckExact(f->listeners) || !PyList_CheckExact(f->stack) ||
        !PyList_CheckExact(f->spans))
        return 1;
    return 0;
}

/* read_fields after Python code ran, where the Python method would go on: its state changed
 * under it is an error now (TypeError), not a fallback. */
static int read_again(PyObject *d, Fields *f) {
    int r = read_fields(d, f);
    if (r == 1)
        PyErr_SetString(PyExc_TypeError, "a phase listener left the Recorder's _open, cuda_timer, "
                                         "phase_listeners, _stack or _spans missing or of another type");
    return r == 0 ? 0 : -1;
}

/* d[name], borrowed; an AttributeError where it is missing. */
static PyObject *item(PyObject *d, PyObject *name) {
    PyObject *v = PyDict_GetItemWithError(d, name);
    if (v == NULL && !PyErr_Occurred())
        PyErr_Format(PyExc_AttributeError, "'Recorder' object has no attribute '%U'", name);
    return v;
}

/* self.own_host_ns += end - start; then self._spans += ("tpkit", start, end, len(self._stack),
 * "probes", self.step_index, start_event, end_event). Recorder._own's span. */
static int own_span(PyObject *d, long long start, long long end, PyObject *start_event, PyObject *end_event) {
    PyObject *own = item(d, s_own_host_ns);
    if (own == NULL) return -1;
    PyObject *took = PyLong_FromLongLong(end - start);
    if (took == NULL) return -1;
    PyObject *sum = PyNumber_Add(own, took);
    Py_DECREF(took);
    if (sum == NULL) return -1;
    int set = PyDict_SetItem(d, s_own_host_ns, sum);
    Py_DECREF(sum);
    if (set < 0) return -1;
    Fields f;
    if (read_again(d, &f) < 0) return -1;
    PyObject *step = item(d, s_step_index);
    if (step == NULL) return -1;
    Py_INCREF(s_tpkit);
    Py_INCREF(s_probes);
    Py_INCREF(step);
    Py_INCREF(start_event);
    Py_INCREF(end_event);
    PyObject *values[8] = {s_tpkit, PyLong_FromLongLong(start), PyLong_FromLongLong(end),
                           PyLong_FromSsize_t(PyList_GET_SIZE(f.stack)), s_probes, step, start_event, end_event};
    return append_stolen(f.spans, values, 8);
}

/* Tell the phase listeners: fn(phase, event, step) for each, the list read as it grows (a
 * Python for loop over it). step NULL: self.step_index at each call. */
static int tell(PyObject *listeners, PyObject *phase, PyObject *event, PyObject *d, PyObject *step) {
    Py_INCREF(listeners);
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(listeners); i++) {
        PyObject *fn = PyList_GET_ITEM(listeners, i);
        PyObject *at = step != NULL ? step : item(d, s_step_index);
        if (at == NULL) {
            Py_DECREF(listeners);
            return -1;
        }
        Py_INCREF(fn);
        Py_INCREF(at);
        PyObject *args[3] = {phase, event, at};
        PyObject *out = PyObject_Vectorcall(fn, args, 3, NULL);
        Py_DECREF(at);
        Py_DECREF(fn);
        if (out == NULL) {
            Py_DECREF(listeners);
            return -1;
        }
        Py_DECREF(out);
    }
    Py_DECREF(listeners);
    return 0;
}

/* The Python method, called where the C one does not apply (before it did anything). */
static PyObject *call_python(PyObject *method, const char *name, PyObject *self, PyObject *const *args,
                             Py_ssize_t nargs, PyObject *kwnames) {
    if (method == NULL) {
        PyErr_Format(PyExc_RuntimeError, "tpkit's C spans were never given Recorder.%s", name);
        return NULL;
    }
    PyObject *with_self[8];
    Py_ssize_t n = nargs + (kwnames == NULL ? 0 : PyTuple_GET_SIZE(kwnames));
    if (n + 1 > 8) return PyObject_CallNoArgs(method); /* (says what is wrong: a TypeError) */
    with_self[0] = self;
    for (Py_ssize_t i = 0; i < n; i++) with_self[i + 1] = args[i];
    return PyObject_Vectorcall(method, with_self, nargs + 1, kwnames);
}

/* Recorder.enter(self, phase, source="user") -> token. */
static PyObject *span_enter(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    PyObject *phase = nargs > 0 ? args[0] : NULL, *source = nargs > 1 ? args[1] : NULL;
    Py_ssize_t nkw = kwnames == NULL ? 0 : PyTuple_GET_SIZE(kwnames);
    if (nargs > 2) goto python; /* (the Python method says what is wrong) */
    for (Py_ssize_t i = 0; i < nkw; i++) {
        PyObject *key = PyTuple_GET_ITEM(kwnames, i);
        if (phase == NULL && PyUnicode_Check(key) && PyUnicode_Compare(key, s_phase) == 0)
            phase = args[nargs + i];
        else if (source == NULL && PyUnicode_Check(key) && PyUnicode_Compare(key, s_source) == 0)
            source = args[nargs + i];
        else
            goto python;
    }
    if (phase == NULL) goto python;
    if (source == NULL) source = s_user;
    read_clock();

    PyObject *d = PyObject_GenericGetDict(self, NULL);
    if (d == NULL) {
        PyErr_Clear();
        goto python;
    }
    Fields f;
    int r = read_fields(d, &f);
    if (r != 0) {
        Py_DECREF(d);
        if (r < 0) return NULL;
        goto python;
    }
    PyObject *count = PyDict_GetItemWithError(f.open, phase); /* borrowed */
    if (count == NULL && PyErr_Occurred()) {
        Py_DECREF(d);
        return NULL;
    }
    long already = 0;
    if (count != NULL) {
        already = PyLong_CheckExact(count) ? PyLong_AsLong(count) : -1;
        if (already < 0) { /* (not a count the Python writes) */
            PyErr_Clear();
            Py_DECREF(d);
            goto python;
        }
    }
    PyObject *sev = NULL, *ev = NULL;
    if (PyList_GET_SIZE(f.listeners) > 0 && already == 0) {
        PyObject *timer = f.timer;
        Py_INCREF(timer);
        long long t = now_ns();
        sev = mark(timer);
        ev = sev == NULL || tell(f.listeners, phase, s_enter, d, NULL) < 0 ? NULL : mark(timer);
        Py_DECREF(timer);
        if (ev == NULL || own_span(d, t, now_ns(), sev, ev) < 0 || read_again(d, &f) < 0) goto fail;
    } else {
        ev = mark(f.timer);
        if (ev == NULL || (f.timer != Py_None && read_again(d, &f) < 0)) goto fail;
    }
    PyObject *step = item(d, s_step_index);
    if (step == NULL) goto fail;
    PyObject *entry = PyList_New(6);
    PyObject *start = PyLong_FromLongLong(now_ns());
    PyObject *token = PyLong_FromSsize_t(PyList_GET_SIZE(f.stack));
    PyObject *now_open = PyLong_FromLong(already + 1);
    if (entry == NULL || start == NULL || token == NULL || now_open == NULL) {
        Py_XDECREF(entry);
        Py_XDECREF(start);
        Py_XDECREF(token);
        Py_XDECREF(now_open);
        goto fail;
    }
    Py_INCREF(phase);
    Py_INCREF(token);
    Py_INCREF(source);
    Py_INCREF(step);
    PyList_SET_ITEM(entry, 0, phase);
    PyList_SET_ITEM(entry, 1, start);
    PyList_SET_ITEM(entry, 2, token);
    PyList_SET_ITEM(entry, 3, source);
    PyList_SET_ITEM(entry, 4, step);
    PyList_SET_ITEM(entry, 5, ev); /* (stolen) */
    ev = NULL;
    r = PyList_Append(f.stack, entry);
    Py_DECREF(entry);
    if (r == 0) r = PyDict_SetItem(f.open, phase, now_open);
    Py_DECREF(now_open);
    Py_XDECREF(sev);
    Py_DECREF(d);
    if (r < 0) {
        Py_DECREF(token);
        return NULL;
    }
    return token;

fail:
    Py_XDECREF(sev);
    Py_XDECREF(ev);
    Py_DECREF(d);
    return NULL;
python:
    return call_python(python_enter, "enter", self, args, nargs, kwnames);
}

/* Recorder.exit(self, token): close the span opened with token and any left open above it. */
static PyObject *span_exit(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    if (nargs != 1 || (kwnames != NULL && PyTuple_GET_SIZE(kwnames) != 0) || !PyLong_CheckExact(args[0]))
        goto python;
    Py_ssize_t token = PyLong_AsSsize_t(args[0]);
    if (token == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        goto python;
    }
    read_clock();
    PyObject *d = PyObject_GenericGetDict(self, NULL);
    if (d == NULL) {
        PyErr_Clear();
        goto python;
    }
    Fields f;
    int r = read_fields(d, &f);
    if (r != 0) {
        Py_DECREF(d);
        if (r < 0) return NULL;
        goto python;
    }
    PyObject *end = PyLong_FromLongLong(now_ns());
    PyObject *ev = end == NULL ? NULL : mark(f.timer);
    if (ev == NULL || (f.timer != Py_None && read_again(d, &f) < 0)) goto fail;
    while (PyList_GET_SIZE(f.stack) > token) {
        Py_ssize_t top = PyList_GET_SIZE(f.stack) - 1;
        PyObject *entry = PyList_GET_ITEM(f.stack, top);
        Py_INCREF(entry);
        if (PyList_SetSlice(f.stack, top, top + 1, NULL) < 0) { /* self._stack.pop() */
            Py_DECREF(entry);
            goto fail;
        }
        if (!PyList_CheckExact(entry) || PyList_GET_SIZE(entry) != 6) {
            Py_DECREF(entry);
            PyErr_SetString(PyExc_ValueError, "an open span of the Recorder is not [phase, start_ns, depth, "
                                              "source, raw_step, event]");
            goto fail;
        }
        PyObject *phase = PyList_GET_ITEM(entry, 0), *step = PyList_GET_ITEM(entry, 4);
        PyObject *count = PyObject_GetItem(f.open, phase); /* (a KeyError where it is missing) */
        PyObject *left = NULL;
        if (count != NULL) {
            long c = PyLong_CheckExact(count) ? PyLong_AsLong(count) : -1;
            if (c > 0) {
                left = PyLong_FromLong(c - 1);
            } else {
                PyErr_Clear();
                PyObject *one = PyLong_FromLong(1);
                left = one == NULL ? NULL : PyNumber_Subtract(count, one);
                Py_XDECREF(one);
            }
            Py_DECREF(count);
        }
        int more = left == NULL || PyDict_SetItem(f.open, phase, left) < 0 ? -1 : PyObject_IsTrue(left);
        Py_XDECREF(left);
        PyObject *values[8] = {phase, PyList_GET_ITEM(entry, 1), end, PyList_GET_ITEM(entry, 2),
                               PyList_GET_ITEM(entry, 3), step, PyList_GET_ITEM(entry, 5), ev};
        for (int i = 0; i < 8; i++) Py_INCREF(values[i]);
        if (more < 0) {
            for (int i = 0; i < 8; i++) Py_DECREF(values[i]);
            Py_DECREF(entry);
            goto fail;
        }
        if (append_stolen(f.spans, values, 8) < 0) {
            Py_DECREF(entry);
            goto fail;
        }
        if (PyList_GET_SIZE(f.listeners) > 0 && !more) {
            long long t = now_ns();
            PyObject *own_ev = NULL;
            if (tell(f.listeners, phase, s_exit, d, step) == 0) {
                PyObject *timer = ev == Py_None ? Py_None : item(d, s_cuda_timer);
                own_ev = timer == NULL ? NULL : mark(timer);
            }
            r = own_ev == NULL ? -1 : own_span(d, t, now_ns(), ev, own_ev);
            Py_XDECREF(own_ev);
            if (r < 0 || read_again(d, &f) < 0) {
                Py_DECREF(entry);
                goto fail;
            }
        }
        Py_DECREF(entry);
    }
    Py_DECREF(end);
    Py_DECREF(ev);
    Py_DECREF(d);
    Py_RETURN_NONE;

fail:
    Py_XDECREF(end);
    Py_XDECREF(ev);
    Py_DECREF(d);
    return NULL;
python:
    return call_python(python_exit, "exit", self, args, nargs, kwnames);
}

static PyMethodDef enter_def = {
    "enter", (PyCFunction)(void (*)(void))span_enter, METH_FASTCALL | METH_KEYWORDS,
    "enter($self, /, phase, source='user')\n--\n\n"
    "Open a span; returns a token for exit (Recorder.enter, in C: recorder_spans.c)."};
static PyMethodDef exit_def = {
    "exit", (PyCFunction)(void (*)(void))span_exit, METH_FASTCALL | METH_KEYWORDS,
    "exit($self, /, token)\n--\n\n"
    "Close the span opened with token and any left open above it (Recorder.exit, in C: "
    "recorder_spans.c)."};

/* methods(Recorder, python_enter, python_exit, recorder_globals, time.perf_counter_ns) ->
 * (enter, exit): the two method descriptors. */
static PyObject *methods(PyObject *module, PyObject *args) {
    PyObject *type, *enter, *exit_, *globals, *clock;
    if (!PyArg_ParseTuple(args, "O!OOO!O:methods", &PyType_Type, &type, &enter, &exit_, &PyDict_Type, &globals,
                          &clock))
        return NULL;
    Py_INCREF(globals);
    Py_INCREF(clock);
    Py_XSETREF(module_dict, globals);
    Py_XSETREF(real_clock, clock);
    if (!PyCallable_Check(enter) || !PyCallable_Check(exit_)) {
        PyErr_SetString(PyExc_TypeError, "methods(type, enter, exit): enter and exit must be callable");
        return NULL;
    }
    Py_INCREF(enter);
    Py_INCREF(exit_);
    Py_XSETREF(python_enter, enter);
    Py_XSETREF(python_exit, exit_);
    PyObject *e = PyDescr_NewMethod((PyTypeObject *)type, &enter_def);
    if (e == NULL) return NULL;
    PyObject *x = PyDescr_NewMethod((PyTypeObject *)type, &exit_def);
    if (x == NULL) {
        Py_DECREF(e);
        return NULL;
    }
    PyObject *out = PyTuple_Pack(2, e, x);
    Py_DECREF(e);
    Py_DECREF(x);
    return out;
}

static PyObject *perf_counter_ns(PyObject *module, PyObject *unused) {
    read_clock();
    return PyLong_FromLongLong(now_ns());
}

static PyMethodDef module_methods[] = {
    {"methods", methods, METH_VARARGS,
     "methods(Recorder, python_enter, python_exit, recorder_globals, time.perf_counter_ns) -> (enter, exit): "
     "the C methods (recorder.py)"},
    {"perf_counter_ns", perf_counter_ns, METH_NOARGS, "The clock the C spans read (time.perf_counter_ns's)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "tpkit_recorder_spans",
    "The Recorder's enter and exit in C (tpkit/capture/recorder.py)", -1, module_methods,
};

#define INTERN(var, text)                                   \
    do {                                                    \
        var = PyUnicode_InternFromString(text);             \
        if (var == NULL) return NULL;                       \
    } while (0)

PyMODINIT_FUNC PyInit_tpkit_recorder_spans(void) {
    INTERN(s_open, "_open");
    INTERN(s_cuda_timer, "cuda_timer");
    INTERN(s_phase_listeners, "phase_listeners");
    INTERN(s_stack, "_stack");
    INTERN(s_spans, "_spans");
    INTERN(s_step_index, "step_index");
    INTERN(s_own_host_ns, "own_host_ns");
    INTERN(s_mark, "mark");
    INTERN(s_perf_counter_ns, "perf_counter_ns");
    INTERN(s_tpkit, "tpkit");
    INTERN(s_probes, "probes");
    INTERN(s_enter, "enter");
    INTERN(s_exit, "exit");
    INTERN(s_user, "user");
    INTERN(s_phase, "phase");
    INTERN(s_source, "source");
    return PyModule_Create(&module_def);
}
