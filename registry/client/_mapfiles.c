/* Map many cache chunk files into tensor memory in one call: registry/client/mapping.py.

Why by hand: a load maps a file per chunk (577 for a 1.16 GB model at 2 MiB chunks). Through
Python, each costs an open, an fstat, an mmap and a madvise through ctypes, a close and the
interpreter around them: about 13 us a file, a third of an unchecked load. Here the same system
calls run in one loop with the GIL released: about 7 us a file, nearly all of it the system calls
themselves. No library maps files at chosen addresses. Built by setup.py where a C compiler is at hand; mapping.py maps one file at a time
through ctypes without it (same result). */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

/* Per file: mapped; not mapped, the slot untouched (missing, not a plain file, another size,
   unreadable); not mapped after a failed MAP_FIXED, which may have unmapped the slot, and fresh anonymous memory put back
   there at once (before another thread's mmap could take the hole); or that too failed: the slot
   is a hole, and the caller must not use its tensor. */
enum { MAPPED = 0, SKIPPED = 1, RESTORED = 2, HOLE = 3 };

PyDoc_STRVAR(map_files_doc,
    "map_files(addrs, sizes, paths) -> bytes\n\n"
    "Map each file of paths (exactly sizes[i] bytes) privately, readable and writable, at addrs[i]\n"
    "(MAP_FIXED), advised MADV_HUGEPAGE where the platform has it. One status byte per file:\n"
    "0 mapped; 1 skipped (missing, not a plain file, another size, unreadable; the slot untouched);\n"
    "2 the mapping failed and fresh anonymous memory is back in the slot; 3 that failed too (the slot\n"
    "is a hole).");

static PyObject *map_files(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *addr_list, *size_list, *path_list;
    if (!PyArg_ParseTuple(args, "O!O!O!", &PyList_Type, &addr_list, &PyList_Type, &size_list, &PyList_Type, &path_list))
        return NULL;
    /* tuples: converting a path may run Python code (__fspath__), which must not change what is read */
    PyObject *addrs = PyList_AsTuple(addr_list), *sizes = PyList_AsTuple(size_list), *paths = PyList_AsTuple(path_list);
    uintptr_t *at = NULL;
    size_t *len = NULL;
    PyObject **encoded = NULL;
    const char **name = NULL;
    PyObject *result = NULL;
    Py_ssize_t n = 0;
    if (addrs == NULL || sizes == NULL || paths == NULL) goto done;
    n = PyTuple_GET_SIZE(paths);
    if (PyTuple_GET_SIZE(addrs) != n || PyTuple_GET_SIZE(sizes) != n) {
        PyErr_SetString(PyExc_ValueError, "addrs, sizes and paths must have one entry per file");
        goto done;
    }
    at = PyMem_Malloc(sizeof(uintptr_t) * (n ? n : 1));
    len = PyMem_Malloc(sizeof(size_t) * (n ? n : 1));
    encoded = PyMem_Calloc(n ? n : 1, sizeof(PyObject *));
    name = PyMem_Malloc(sizeof(char *) * (n ? n : 1));
    if (at == NULL || len == NULL || encoded == NULL || name == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        at[i] = (uintptr_t)PyLong_AsVoidPtr(PyTuple_GET_ITEM(addrs, i));
        if (PyErr_Occurred()) goto done;
        len[i] = PyLong_AsSize_t(PyTuple_GET_ITEM(sizes, i));
        if (PyErr_Occurred()) goto done;
        if (!PyUnicode_FSConverter(PyTuple_GET_ITEM(paths, i), &encoded[i])) goto done;
        name[i] = PyBytes_AS_STRING(encoded[i]);
    }
    result = PyBytes_FromStringAndSize(NULL, n);
    if (result == NULL) goto done;
    char *status = PyBytes_AS_STRING(result);
    Py_BEGIN_ALLOW_THREADS
#ifdef MADV_HUGEPAGE
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
#endif
    for (Py_ssize_t i = 0; i < n; i++) {
        status[i] = SKIPPED;
        /* O_NONBLOCK: a fifo at a chunk's name made the open wait for a writer forever; O_NOFOLLOW: a
           link is no cache file (as registry/client/cache.py opens them) */
        int fd = open(name[i], O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOFOLLOW);
        if (fd < 0) continue;
        struct stat st;
        /* a short file would raise SIGBUS on first touch, not an error: its size is checked first;
           anything but a plain file is skipped (the caller reads it, finds it missing, fetches it again) */
        if (fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && (size_t)st.st_size == len[i]) {
            void *p = mmap((void *)at[i], len[i], PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_FIXED, fd, 0);
            if (p == (void *)at[i]) {
                status[i] = MAPPED;
#ifdef MADV_HUGEPAGE
                /* advice only (see mapping.py): a refusal changes nothing */
                madvise(p, (len[i] + page - 1) / page * page, MADV_HUGEPAGE);
#endif
            } else {
                void *back = mmap((void *)at[i], len[i], PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
                status[i] = back == (void *)at[i] ? RESTORED : HOLE;
            }
        }
        close(fd);
    }
    Py_END_ALLOW_THREADS
done:
    if (encoded != NULL)
        for (Py_ssize_t i = 0; i < n; i++) Py_XDECREF(encoded[i]);
    PyMem_Free(at);
    PyMem_Free(len);
    PyMem_Free(encoded);
    PyMem_Free(name);
    Py_XDECREF(addrs);
    Py_XDECREF(sizes);
    Py_XDECREF(paths);
    if (PyErr_Occurred()) {
        Py_XDECREF(result);
        return NULL;
    }
    return result;
}

static PyMethodDef methods[] = {
    {"map_files", map_files, METH_VARARGS, map_files_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_mapfiles",
    .m_doc = "Many chunk files mapped in one call.",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__mapfiles(void) { return PyModule_Create(&module); }
