/* The rows of a binary COPY ... TO STDOUT, taken from libpq and split into one binary Arrow
 * column each, in C: per row a Python loop cost more than the server's send functions
 * (docs/architecture.md, "The initial snapshot").
 *
 * libpq's PQgetCopyData and PQfreemem come in as addresses (binary_copy.py finds them in the libpq
 * psycopg runs on), so the PGconn is only ever touched by its own library.
 *
 * A CopyData message holds one row (the first one the file header too; the last one is the
 * trailer, int16 -1). A row: int16 field count, then per field an int32 length (-1: NULL) and
 * that many bytes. Each column keeps its values one after the other, int64 offsets and a
 * validity bitmap; take() hands them over as bytes and starts a new block.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

typedef int (*get_copy_data_fn)(void *conn, char **buffer, int async);
typedef void (*free_mem_fn)(void *ptr);

static const char SIGNATURE[11] = {'P', 'G', 'C', 'O', 'P', 'Y', '\n', (char)0xff, '\r', '\n', 0};
#define HEADER_SIZE 19

enum { RECEIVE_LIMIT = 1, RECEIVE_WAIT = 0, RECEIVE_ENDED = -1, RECEIVE_FAILED = -2 };

typedef struct {
    char *data;
    Py_ssize_t used, size;
} Buffer;

typedef struct {
    Buffer values, offsets, validity; /* offsets: int64, one per row after the first 0 */
    Py_ssize_t nulls;
} Column;

typedef struct {
    PyObject_HEAD
    int columns;
    Column *column;
    Py_ssize_t rows, bytes;
    int header_done, ended;
} RowSplitter;

static int reserve(Buffer *b, Py_ssize_t more) {
    if (b->used + more <= b->size) return 0;
    Py_ssize_t size = b->size ? b->size : 4096;
    while (size < b->used + more) size *= 2;
    char *data = PyMem_Realloc(b->data, size);
    if (data == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    b->data = data;
    b->size = size;
    return 0;
}

static inline int32_t int32_at(const unsigned char *p) {
    return (int32_t)(((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8) | (uint32_t)p[3]);
}

static inline int16_t int16_at(const unsigned char *p) { return (int16_t)(((uint16_t)p[0] << 8) | (uint16_t)p[1]); }

static int malformed(RowSplitter *self, const char *reason) {
    PyErr_Format(PyExc_ValueError, "%s (row %zd of the block)", reason, self->rows + 1);
    return -1;
}

/* Append one row to the columns, or raise ValueError naming what does not fit. */
static int add_row(RowSplitter *self, const unsigned char *row, Py_ssize_t length) {
    char reason[96];
    if (length < 2) return malformed(self, "a row shorter than its field count");
    int fields = int16_at(row);
    if (fields != self->columns) {
        snprintf(reason, sizeof reason, "a row with %d fields, expected %d", fields, self->columns);
        return malformed(self, reason);
    }
    const unsigned char *at = row + 2, *end = row + length;
    /* check the whole row first, so a bad row leaves the columns as they were */
    for (int c = 0; c < self->columns; c++) {
        if (end - at < 4) {
            snprintf(reason, sizeof reason, "column %d's length does not fit the row", c + 1);
            return malformed(self, reason);
        }
        int32_t size = int32_at(at);
        at += 4;
        if (size < -1) {
            snprintf(reason, sizeof reason, "column %d has a negative length", c + 1);
            return malformed(self, reason);
        }
        if (size > 0) {
            if (end - at < size) {
                snprintf(reason, sizeof reason, "column %d's value does not fit the row", c + 1);
                return malformed(self, reason);
            }
            at += size;
        }
    }
    if (at != end) return malformed(self, "the row's end does not fit the row");
    Py_ssize_t row_index = self->rows;
    at = row + 2;
    for (int c = 0; c < self->columns; c++) {
        Column *column = &self->column[c];
        int32_t size = int32_at(at);
        at += 4;
        if (reserve(&column->offsets, 8) < 0 || (row_index % 8 == 0 && reserve(&column->validity, 1) < 0)) return -1;
        if (row_index % 8 == 0) column->validity.data[column->validity.used++] = 0;
        if (size >= 0) {
            if (reserve(&column->values, size) < 0) return -1;
            memcpy(column->values.data + column->values.used, at, size);
            column->values.used += size;
            column->validity.data[column->validity.used - 1] |= (char)(1 << (row_index % 8));
            at += size;
        } else {
            column->nulls++;
        }
        int64_t offset = column->values.used;
        memcpy(column->offsets.data + column->offsets.used, &offset, 8);
        column->offsets.used += 8;
    }
    self->rows++;
    self->bytes += length;
    return 0;
}

/* One CopyData message: the header first (with a row, the trailer or nothing), then a row or the
 * trailer. */
static int add_message(RowSplitter *self, const unsigned char *message, Py_ssize_t length) {
    if (self->ended) return malformed(self, "a message after the trailer");
    if (!self->header_done) {
        if (length < HEADER_SIZE) return malformed(self, "the header is cut short");
        int32_t flags = int32_at(message + 11), extension = int32_at(message + 15);
        if (memcmp(message, SIGNATURE, 11) != 0 || (flags & 0x1FFFF) || extension < 0 ||
            extension > length - HEADER_SIZE) {
            char reason[80];
            snprintf(reason, sizeof reason, "unexpected header (flags %d, extension of %d bytes)", (int)flags,
                     (int)extension);
            return malformed(self, reason);
        }
        self->header_done = 1;
        message += HEADER_SIZE + extension;
        length -= HEADER_SIZE + extension;
        if (length == 0) return 0;
    }
    if (length == 2 && message[0] == 0xff && message[1] == 0xff) {
        self->ended = 1;
        return 0;
    }
    return add_row(self, message, length);
}

static void free_columns(RowSplitter *self) {
    for (int c = 0; c < self->columns; c++) {
        PyMem_Free(self->column[c].values.data);
        PyMem_Free(self->column[c].offsets.data);
        PyMem_Free(self->column[c].validity.data);
    }
}

static int RowSplitter_init(RowSplitter *self, PyObject *args, PyObject *kwds) {
    static char *keywords[] = {"columns", NULL};
    int columns;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "i", keywords, &columns)) return -1;
    if (columns < 0 || columns > 1664) {
        PyErr_Format(PyExc_ValueError, "a table has 0 to 1664 columns, not %d", columns);
        return -1;
    }
    if (self->column) { /* __init__ called again: start empty */
        free_columns(self);
        PyMem_Free(self->column);
        self->column = NULL;
    }
    self->column = PyMem_Calloc(columns ? columns : 1, sizeof(Column));
    if (self->column == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    self->columns = columns;
    self->rows = self->bytes = 0;
    self->header_done = self->ended = 0;
    return 0;
}

static void RowSplitter_dealloc(RowSplitter *self) {
    if (self->column) free_columns(self);
    PyMem_Free(self->column);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *RowSplitter_add_message(RowSplitter *self, PyObject *arg) {
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0) return NULL;
    int failed = add_message(self, view.buf, view.len);
    PyBuffer_Release(&view);
    if (failed) return NULL;
    Py_RETURN_NONE;
}

static PyObject *RowSplitter_receive(RowSplitter *self, PyObject *args) {
    unsigned long long conn, get_address, free_address;
    Py_ssize_t max_rows, max_bytes;
    if (!PyArg_ParseTuple(args, "KKKnn", &conn, &get_address, &free_address, &max_rows, &max_bytes)) return NULL;
    get_copy_data_fn get_copy_data = (get_copy_data_fn)(uintptr_t)get_address;
    free_mem_fn free_mem = (free_mem_fn)(uintptr_t)free_address;
    while (self->rows < max_rows && self->bytes < max_bytes) {
        char *message = NULL;
        int length = get_copy_data((void *)(uintptr_t)conn, &message, 1);
        if (length == 0) return PyLong_FromLong(RECEIVE_WAIT);
        if (length < 0) return PyLong_FromLong(length == -1 ? RECEIVE_ENDED : RECEIVE_FAILED);
        int failed = add_message(self, (const unsigned char *)message, length);
        free_mem(message);
        if (failed) return NULL;
    }
    return PyLong_FromLong(RECEIVE_LIMIT);
}

static PyObject *buffer_bytes(Buffer *b) {
    PyObject *bytes = PyBytes_FromStringAndSize(b->data, b->used);
    b->used = 0;
    return bytes;
}

/* The offsets with their leading 0, as int32 where the values fit, else int64. */
static PyObject *offsets_bytes(Column *column, Py_ssize_t rows, int wide) {
    size_t width = wide ? 8 : 4;
    PyObject *bytes = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)((rows + 1) * width));
    if (bytes == NULL) return NULL;
    char *out = PyBytes_AS_STRING(bytes);
    const int64_t *offsets = (const int64_t *)column->offsets.data;
    if (wide) {
        memset(out, 0, 8);
        if (rows) memcpy(out + 8, offsets, rows * 8);
    } else {
        int32_t *narrow = (int32_t *)out;
        narrow[0] = 0;
        for (Py_ssize_t i = 0; i < rows; i++) narrow[i + 1] = (int32_t)offsets[i];
    }
    column->offsets.used = 0;
    return bytes;
}

static PyObject *RowSplitter_take(RowSplitter *self, PyObject *Py_UNUSED(ignored)) {
    PyObject *columns = PyList_New(self->columns);
    if (columns == NULL) return NULL;
    for (int c = 0; c < self->columns; c++) {
        Column *column = &self->column[c];
        int wide = column->values.used > INT32_MAX;
        PyObject *validity = column->nulls ? buffer_bytes(&column->validity) : (Py_INCREF(Py_None), Py_None);
        column->validity.used = 0;
        PyObject *offsets = offsets_bytes(column, self->rows, wide);
        PyObject *values = buffer_bytes(&column->values);
        PyObject *nulls = PyLong_FromSsize_t(column->nulls);
        column->nulls = 0;
        if (validity == NULL || offsets == NULL || values == NULL || nulls == NULL) {
            Py_XDECREF(validity);
            Py_XDECREF(offsets);
            Py_XDECREF(values);
            Py_XDECREF(nulls);
            Py_DECREF(columns);
            return NULL;
        }
        PyObject *item = PyTuple_Pack(5, validity, offsets, values, nulls, wide ? Py_True : Py_False);
        Py_DECREF(validity);
        Py_DECREF(offsets);
        Py_DECREF(values);
        Py_DECREF(nulls);
        if (item == NULL) {
            Py_DECREF(columns);
            return NULL;
        }
        PyList_SET_ITEM(columns, c, item);
    }
    self->rows = 0;
    self->bytes = 0;
    return columns;
}

static PyObject *RowSplitter_get_rows(RowSplitter *self, void *Py_UNUSED(closure)) {
    return PyLong_FromSsize_t(self->rows);
}

static PyMethodDef RowSplitter_methods[] = {
    {"add_message", (PyCFunction)RowSplitter_add_message, METH_O,
     "Add one CopyData message's contents (the header, a row, or the trailer)."},
    {"receive", (PyCFunction)RowSplitter_receive, METH_VARARGS,
     "receive(conn, get_copy_data, free_mem, max_rows, max_bytes): take rows from libpq until a limit."},
    {"take", (PyCFunction)RowSplitter_take, METH_NOARGS,
     "The block's columns as (validity, offsets, values, nulls, wide), and a new block."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef RowSplitter_getset[] = {
    {"rows", (getter)RowSplitter_get_rows, NULL, "Rows in the block.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject RowSplitterType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "cdc_assets.source._copy_rows.RowSplitter",
    .tp_basicsize = sizeof(RowSplitter),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Binary COPY rows split into one binary column each.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)RowSplitter_init,
    .tp_dealloc = (destructor)RowSplitter_dealloc,
    .tp_methods = RowSplitter_methods,
    .tp_getset = RowSplitter_getset,
};

static struct PyModuleDef copy_rows_module = {
    PyModuleDef_HEAD_INIT, .m_name = "cdc_assets.source._copy_rows", .m_doc = "Binary COPY rows split into columns, in C.", .m_size = -1,
};

PyMODINIT_FUNC PyInit__copy_rows(void) {
    if (PyType_Ready(&RowSplitterType) < 0) return NULL;
    PyObject *module = PyModule_Create(&copy_rows_module);
    if (module == NULL) return NULL;
    Py_INCREF(&RowSplitterType);
    if (PyModule_AddObject(module, "RowSplitter", (PyObject *)&RowSplitterType) < 0 ||
        PyModule_AddIntConstant(module, "RECEIVE_LIMIT", RECEIVE_LIMIT) < 0 ||
        PyModule_AddIntConstant(module, "RECEIVE_WAIT", RECEIVE_WAIT) < 0 ||
        PyModule_AddIntConstant(module, "RECEIVE_ENDED", RECEIVE_ENDED) < 0 ||
        PyModule_AddIntConstant(module, "RECEIVE_FAILED", RECEIVE_FAILED) < 0) {
        Py_DECREF(&RowSplitterType);
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
