/* tpkit's module-call route in C: what nn.Module.__call__ is while a phase probe is installed.
 *
 * Why and how: module_calls.py. In short, every module call of the process comes here (through
 * the Route object put in nn.Module's dict); an outermost call of the loop's thread goes to the
 * probe's handler, every other call straight on to torch's own __call__, with no Python frame
 * of tpkit's in between. A Route is a method descriptor: a call `module(x)` reaches `route_call`
 * with the module first, and reading `nn.Module.__call__` gives the Python function the route
 * stands for (the one dynamo traces), so torch.compile sees what it saw before.
 *
 * Only plain CPython API: no torch header, built in well under a second (native.py). The GIL
 * guards the state (one probe at a time, set from Python). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pythread.h>
#include <stddef.h>

/* nn.Module.__call__ as the probe found it (torch's own, unless another library had replaced
 * it): every call not handled by the probe goes there. */
static PyObject *torch_call = NULL;
/* The probe's handler of an outermost call, called as handler(module, *args, **kwargs);
 * NULL while no probe is installed (then every call goes to torch_call). */
static PyObject *outer_call = NULL;
/* torch.compiler's dict, where "_is_compiling_flag" says that torch.export or a compile session
 * runs this Python eagerly: then every call goes to torch_call, as the Python route does. */
static PyObject *compiler_dict = NULL;
static PyObject *compiling_flag_name = NULL;
/* While that flag is up: compiling.compiling(), which says whether it is this thread's session
 * (the flag is the process's: a model compiled in another thread had turned the probe off). */
static PyObject *thread_compiles = NULL;
/* The thread whose outermost call is running (its inner calls go to torch_call). */
static unsigned long inside_tid = 0;
static int inside = 0;

static int compiling(void) {
    if (compiler_dict == NULL) return 0;
    PyObject *flag = PyDict_GetItemWithError(compiler_dict, compiling_flag_name); /* borrowed */
    if (flag == NULL) {
        PyErr_Clear();
        return 0;
    }
    if (flag != Py_True) return 0;
    if (thread_compiles == NULL) return 1;
    PyObject *here = PyObject_CallNoArgs(thread_compiles);
    if (here == NULL) { /* cannot tell: as compiling, torch's call */
        PyErr_Clear();
        return 1;
    }
    int yes = PyObject_IsTrue(here);
    Py_DECREF(here);
    if (yes < 0) PyErr_Clear();
    return yes != 0;
}

typedef struct {
    PyObject_HEAD
    PyObject *face; /* the Python function this route stands for (module_calls._module_call) */
    vectorcallfunc vectorcall;
} RouteObject;

/* module(*args, **kwargs): args[0] is the module. */
static PyObject *route_call(PyObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    if (PyVectorcall_NARGS(nargsf) < 1) {
        PyErr_SetString(PyExc_TypeError, "nn.Module.__call__ needs the module as its first argument");
        return NULL;
    }
    PyObject *target = torch_call;
    if (outer_call != NULL && !(inside && PyThread_get_thread_ident() == inside_tid) && !compiling())
        target = outer_call;
    if (target == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "tpkit's module-call route was never given torch's call");
        return NULL;
    }
    Py_INCREF(target); /* the probe may be removed inside the call */
    PyObject *out = PyObject_Vectorcall(target, args, nargsf, kwnames);
    Py_DECREF(target);
    return out;
}

/* nn.Module.__call__ (no instance): the Python face; module.__call__: the face bound to it. */
static PyObject *route_get(PyObject *self, PyObject *obj, PyObject *type) {
    PyObject *face = ((RouteObject *)self)->face;
    if (obj == NULL || obj == Py_None) {
        Py_INCREF(face);
        return face;
    }
    return PyMethod_New(face, obj);
}

static PyObject *route_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    PyObject *face;
    if (kwargs != NULL && PyDict_GET_SIZE(kwargs) != 0) {
        PyErr_SetString(PyExc_TypeError, "Route(face) takes no keyword arguments");
        return NULL;
    }
    if (!PyArg_ParseTuple(args, "O:Route", &face)) return NULL;
    if (!PyCallable_Check(face)) {
        PyErr_SetString(PyExc_TypeError, "Route(face): face must be callable");
        return NULL;
    }
    RouteObject *self = (RouteObject *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    Py_INCREF(face);
    self->face = face;
    self->vectorcall = route_call;
    return (PyObject *)self;
}

static int route_traverse(PyObject *self, visitproc visit, void *arg) {
    Py_VISIT(((RouteObject *)self)->face);
    return 0;
}

static int route_clear(PyObject *self) {
    Py_CLEAR(((RouteObject *)self)->face);
    return 0;
}

static void route_dealloc(PyObject *self) {
    PyObject_GC_UnTrack(self);
    route_clear(self);
    Py_TYPE(self)->tp_free(self);
}

static PyTypeObject RouteType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "tpkit_module_calls.Route",
    .tp_doc = "nn.Module.__call__ while a tpkit phase probe is installed (module_calls.py)",
    .tp_basicsize = sizeof(RouteObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL |
                Py_TPFLAGS_METHOD_DESCRIPTOR,
    .tp_vectorcall_offset = offsetof(RouteObject, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_descr_get = route_get,
    .tp_new = route_new,
    .tp_traverse = route_traverse,
    .tp_clear = route_clear,
    .tp_dealloc = route_dealloc,
};

/* route(torch_call, outer_call or None, torch.compiler.__dict__, thread_compiles): where calls
 * go from now on. */
static PyObject *set_route(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError,
                        "route(torch_call, outer_call, compiler_dict, thread_compiles) takes 4 arguments");
        return NULL;
    }
    if (!PyCallable_Check(args[0]) || (args[1] != Py_None && !PyCallable_Check(args[1])) ||
        !PyDict_Check(args[2]) || !PyCallable_Check(args[3])) {
        PyErr_SetString(PyExc_TypeError, "route(torch_call, outer_call, compiler_dict, thread_compiles): a "
                                         "callable, a callable or None, a dict and a callable");
        return NULL;
    }
    Py_INCREF(args[3]);
    Py_XSETREF(thread_compiles, args[3]);
    Py_INCREF(args[0]);
    Py_XSETREF(torch_call, args[0]);
    if (args[1] == Py_None) {
        Py_CLEAR(outer_call);
        inside = 0;
    } else {
        Py_INCREF(args[1]);
        Py_XSETREF(outer_call, args[1]);
    }
    Py_INCREF(args[2]);
    Py_XSETREF(compiler_dict, args[2]);
    Py_RETURN_NONE;
}

/* inside(thread id or None): the thread whose outermost call runs now, or none. */
static PyObject *set_inside(PyObject *module, PyObject *arg) {
    if (arg == Py_None) {
        inside = 0;
        Py_RETURN_NONE;
    }
    unsigned long tid = PyLong_AsUnsignedLong(arg);
    if (tid == (unsigned long)-1 && PyErr_Occurred()) return NULL;
    inside_tid = tid;
    inside = 1;
    Py_RETURN_NONE;
}

/* state() -> (outer_call or None, inside thread id or None) */
static PyObject *state(PyObject *module, PyObject *unused) {
    PyObject *tid = inside ? PyLong_FromUnsignedLong(inside_tid) : Py_NewRef(Py_None);
    if (tid == NULL) return NULL;
    return Py_BuildValue("(ON)", outer_call != NULL ? outer_call : Py_None, tid);
}

static PyMethodDef methods[] = {
    {"route", (PyCFunction)(void (*)(void))set_route, METH_FASTCALL,
     "route(torch_call, outer_call, compiler_dict, thread_compiles): where module calls go from now on "
     "(outer_call None: all to torch_call)"},
    {"inside", set_inside, METH_O, "inside(tid or None): the thread whose outermost module call runs"},
    {"state", state, METH_NOARGS, "state() -> (outer_call or None, inside thread id or None)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT, "tpkit_module_calls",
    "nn.Module.__call__ in C while a tpkit phase probe is installed (module_calls.py)", -1, methods,
};

PyMODINIT_FUNC PyInit_tpkit_module_calls(void) {
    if (PyType_Ready(&RouteType) < 0) return NULL;
    compiling_flag_name = PyUnicode_InternFromString("_is_compiling_flag");
    if (compiling_flag_name == NULL) return NULL;
    PyObject *m = PyModule_Create(&moduledef);
    if (m == NULL) return NULL;
    Py_INCREF(&RouteType);
    if (PyModule_AddObject(m, "Route", (PyObject *)&RouteType) < 0) {
        Py_DECREF(&RouteType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
