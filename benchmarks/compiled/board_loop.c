/* The step board's two loops, compiled: the prototype behind `python -m benchmarks.compiled_cycle`.
 *
 * A worker's serve loop (`serve`) and a parent's lockstep step (`step`) on one env's words in
 * shared memory, as envmanager's step board has them: the parent raises the request word to
 * the next ordinal, the worker spins until it sees it, calls the env's step() (the only Python
 * left), writes observation, reward and flags into shared arrays and sets the answer word to
 * the ordinal. Words are read with acquire and written with release (x86: plain moves).
 * Not a product path: it measures what is left of the cycle once neither side runs Python of
 * its own per request. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

/* serve(words, request, answer, env, action, observation, reward, flags, steps) */
static PyObject *serve(PyObject *self, PyObject *args) {
    Py_buffer words, action, observation, reward, flags;
    Py_ssize_t request, answer, steps;
    PyObject *env;
    if (!PyArg_ParseTuple(args, "w*nnOw*w*w*w*n", &words, &request, &answer, &env, &action, &observation, &reward,
                          &flags, &steps))
        return NULL;
    int64_t *w = (int64_t *)words.buf;
    int64_t *act = (int64_t *)action.buf;
    double *rew = (double *)reward.buf;
    uint8_t *flag = (uint8_t *)flags.buf;
    PyObject *name = PyUnicode_InternFromString("step");
    PyObject *result = NULL;
    int64_t served = __atomic_load_n(&w[answer], __ATOMIC_ACQUIRE);
    for (Py_ssize_t k = 0; k < steps; k++) {
        int64_t asked;
        Py_BEGIN_ALLOW_THREADS
        while ((asked = __atomic_load_n(&w[request], __ATOMIC_ACQUIRE)) == served)
            cpu_relax();
        Py_END_ALLOW_THREADS
        PyObject *a = PyLong_FromLongLong(act[0]);
        PyObject *out = PyObject_CallMethodOneArg(env, name, a);
        Py_DECREF(a);
        if (out == NULL) goto fail;
        Py_buffer obs;
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(out, 0), &obs, PyBUF_C_CONTIGUOUS) < 0) { Py_DECREF(out); goto fail; }
        memcpy(observation.buf, obs.buf, obs.len < observation.len ? obs.len : observation.len);
        PyBuffer_Release(&obs);
        rew[0] = PyFloat_AsDouble(PyTuple_GET_ITEM(out, 1));
        flag[0] = (uint8_t)PyObject_IsTrue(PyTuple_GET_ITEM(out, 2));
        flag[1] = (uint8_t)PyObject_IsTrue(PyTuple_GET_ITEM(out, 3));
        Py_DECREF(out);
        served = asked;
        __atomic_store_n(&w[answer], asked, __ATOMIC_RELEASE);
    }
    result = Py_None;
    Py_INCREF(result);
fail:
    Py_DECREF(name);
    PyBuffer_Release(&words); PyBuffer_Release(&action); PyBuffer_Release(&observation);
    PyBuffer_Release(&reward); PyBuffer_Release(&flags);
    return result;
}

/* step(words, request, answer): ask for the next step and spin until it is answered; returns
 * the ordinal. */
static PyObject *step(PyObject *self, PyObject *args) {
    Py_buffer words;
    Py_ssize_t request, answer;
    if (!PyArg_ParseTuple(args, "w*nn", &words, &request, &answer)) return NULL;
    int64_t *w = (int64_t *)words.buf;
    int64_t ordinal = __atomic_load_n(&w[request], __ATOMIC_RELAXED) + 1;
    __atomic_store_n(&w[request], ordinal, __ATOMIC_RELEASE);
    Py_BEGIN_ALLOW_THREADS
    while (__atomic_load_n(&w[answer], __ATOMIC_ACQUIRE) != ordinal)
        cpu_relax();
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&words);
    return PyLong_FromLongLong(ordinal);
}

static PyMethodDef methods[] = {
    {"serve", serve, METH_VARARGS, "The worker's serve loop, compiled."},
    {"step", step, METH_VARARGS, "The parent's lockstep step, compiled."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "board_loop", NULL, -1, methods};

PyMODINIT_FUNC PyInit_board_loop(void) { return PyModule_Create(&module); }
