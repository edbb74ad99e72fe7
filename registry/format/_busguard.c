/* A guard for the read-only maps of files being pushed: a file cut short while it is read (a
 * trainer reopening its checkpoint with O_TRUNC, a copy into it) makes every later read of a page
 * past its new end raise SIGBUS, which ends the process with "Bus error" and no message; Python
 * cannot catch it, since the faulting read runs again as soon as any handler returns.
 *
 * guard(map) notes the span of a mapped buffer. A SIGBUS for an address inside a noted span maps
 * one page of zeros over the faulting page and marks the span hit; the read then goes on and reads
 * zeros, and the pusher, which asks hit() before it commits, refuses the push with one line
 * instead (registry/format/chunking.py). Any other SIGBUS is handed back to the handler that was there
 * before (or the default), as if this one had never been installed: a real fault still ends the
 * process as before.
 *
 * Written by hand because no library does this: the handler must run in C, inside the signal.
 * mmap() is not on POSIX's list of async-signal-safe calls, but on Linux it is a single system
 * call with no lock in user space (glibc's wrapper takes none), which is what that list guards
 * against. Spans are noted and dropped with the GIL held; the handler only reads them. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#define SPANS 1024 /* maps guarded at once; a push holds one per file, and past this a map is unguarded */

typedef struct {
    _Atomic uintptr_t start; /* 0: a free slot */
    _Atomic uintptr_t end;
    _Atomic int hit;
} span_t;

static span_t spans[SPANS];
static struct sigaction previous;
static uintptr_t page_size, page_mask;
static _Atomic int handed_back; /* a SIGBUS not ours was handed to the previous handler */

static void on_sigbus(int sig, siginfo_t *info, void *context)
{
    uintptr_t addr = (uintptr_t)info->si_addr;
    if (info->si_code == BUS_ADRERR) {
        for (int i = 0; i < SPANS; i++) {
            uintptr_t start = atomic_load(&spans[i].start);
            if (start == 0 || addr < start || addr >= atomic_load(&spans[i].end))
                continue;
            void *at = (void *)(addr & page_mask);
            if (mmap(at, page_size, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0)
                != MAP_FAILED) {
                atomic_store(&spans[i].hit, 1);
                return; /* the read runs again, on the page of zeros */
            }
            break;
        }
    }
    /* Not ours: put back the handler that was there and let the fault (which happens again as
     * this returns) or a sent signal (raised again, delivered once this returns) reach it. Back
     * here a second time, that handler handed it on to this one (faulthandler, enabled over ours,
     * keeps ours as the handler it restores and raises again): the default action ends it then,
     * as in a process without this module, instead of the two passing it back and forth. */
    (void)context;
    if (atomic_exchange(&handed_back, 1)) {
        struct sigaction dfl;
        memset(&dfl, 0, sizeof dfl);
        dfl.sa_handler = SIG_DFL;
        sigemptyset(&dfl.sa_mask);
        sigaction(SIGBUS, &dfl, NULL);
    } else {
        sigaction(SIGBUS, &previous, NULL);
    }
    if (info->si_code <= 0)
        raise(sig);
}

/* Ours on top of whatever is installed now (faulthandler, say, enabled after the last call). */
static int install(void)
{
    struct sigaction current;
    if (sigaction(SIGBUS, NULL, &current) != 0)
        return -1;
    if ((current.sa_flags & SA_SIGINFO) && current.sa_sigaction == on_sigbus)
        return 0;
    struct sigaction ours;
    memset(&ours, 0, sizeof ours);
    ours.sa_sigaction = on_sigbus;
    ours.sa_flags = SA_SIGINFO | SA_RESTART;
    sigemptyset(&ours.sa_mask);
    previous = current;
    atomic_store(&handed_back, 0);
    return sigaction(SIGBUS, &ours, NULL);
}

static PyObject *guard(PyObject *self, PyObject *arg)
{
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) != 0)
        return NULL;
    uintptr_t start = (uintptr_t)view.buf, end = start + (uintptr_t)view.len;
    PyBuffer_Release(&view);
    if (end == start || install() != 0)
        return PyLong_FromLong(-1);
    for (int i = 0; i < SPANS; i++) {
        if (atomic_load(&spans[i].start) != 0)
            continue;
        atomic_store(&spans[i].hit, 0);
        atomic_store(&spans[i].end, end);
        atomic_store(&spans[i].start, start & page_mask);
        return PyLong_FromLong(i);
    }
    return PyLong_FromLong(-1);
}

static int slot_of(PyObject *arg)
{
    long i = PyLong_AsLong(arg);
    if (i == -1 && PyErr_Occurred())
        return -2;
    if (i < 0 || i >= SPANS || atomic_load(&spans[i].start) == 0) {
        PyErr_Format(PyExc_ValueError, "no guarded span %ld", i);
        return -2;
    }
    return (int)i;
}

static PyObject *hit(PyObject *self, PyObject *arg)
{
    int i = slot_of(arg);
    if (i < 0)
        return NULL;
    return PyBool_FromLong(atomic_load(&spans[i].hit));
}

static PyObject *release(PyObject *self, PyObject *arg)
{
    int i = slot_of(arg);
    if (i < 0)
        return NULL;
    atomic_store(&spans[i].start, 0);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"guard", guard, METH_O, "guard(buffer) -> slot (or -1 where none is free): note a mapped buffer's span"},
    {"hit", hit, METH_O, "hit(slot) -> whether a read past its file's end was answered with zeros"},
    {"release", release, METH_O, "release(slot): stop guarding that span (before the map is closed)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_busguard", NULL, -1, methods};

PyMODINIT_FUNC PyInit__busguard(void)
{
    long size = sysconf(_SC_PAGESIZE);
    page_size = size > 0 ? (uintptr_t)size : 4096;
    page_mask = ~(page_size - 1);
    return PyModule_Create(&module);
}
