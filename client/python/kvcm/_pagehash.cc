// kvcm._pagehash: the kvcm page hash for Python, compiled from common/page_hash_core.h (the
// code common/page_hash.cc runs), with the plain CPython C API. kvcm.hashing wraps it and
// documents the API; kvcm/hashing/pure.py is the reference it must agree with.
//
// Tokens may be any sequence of ints, or a 1-D C-contiguous buffer: int32 ones (array('i'),
// numpy int32) are hashed in place, other integer formats are converted with a range check,
// and bytes / bytearray (format 'B') are read as little-endian int32 tokens. The GIL is
// released while hashing.
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "common/page_hash_core.h"

namespace {

namespace core = kvcm::page_hash_core;

// A Py_buffer released when it goes out of scope.
class BufferView {
 public:
  BufferView() = default;
  BufferView(const BufferView&) = delete;
  BufferView& operator=(const BufferView&) = delete;
  ~BufferView() {
    if (held_) PyBuffer_Release(&view_);
  }
  Py_buffer* get() { return &view_; }
  void set_held() { held_ = true; }

 private:
  Py_buffer view_{};
  bool held_ = false;
};

// Reads a 16-byte key or hash argument named `field`. False with ValueError otherwise.
bool Read16(const Py_buffer& b, const char* field, core::Hash128* out) {
  if (b.len != 16) {
    PyErr_Format(PyExc_ValueError, "%s: must be 16 bytes, got %zd", field, b.len);
    return false;
  }
  std::memcpy(out, b.buf, 16);
  return true;
}

PyObject* BytesOf(const core::Hash128& h) {
  return PyBytes_FromStringAndSize(reinterpret_cast<const char*>(&h), 16);
}

bool OutOfInt32(long long v) {
  return v < std::numeric_limits<int32_t>::min() || v > std::numeric_limits<int32_t>::max();
}

// The tokens of a Python argument as int32: borrowed from a buffer when it holds int32,
// copied into `owned_` otherwise.
class Tokens {
 public:
  // False with a Python exception set when `obj` holds no valid tokens.
  bool Parse(PyObject* obj) {
    if (PyObject_CheckBuffer(obj)) {
      if (PyObject_GetBuffer(obj, view_.get(), PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) == 0) {
        view_.set_held();
        return FromBuffer(*view_.get());
      }
      // Not contiguous (a strided numpy view): read it as a sequence.
      PyErr_Clear();
    }
    return FromSequence(obj);
  }

  const int32_t* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  bool FromBuffer(const Py_buffer& b) {
    if (b.ndim > 1) {
      PyErr_Format(PyExc_TypeError, "tokens: expected a 1-D buffer, got %d dimensions", b.ndim);
      return false;
    }
    std::string format = b.format != nullptr ? b.format : "B";
    if (!format.empty() && (format[0] == '@' || format[0] == '=' || format[0] == '<')) {
      format.erase(0, 1);
    }
    const size_t bytes = static_cast<size_t>(b.len);
    if ((format == "B" || format == "c") && b.itemsize == 1) {
      // Raw bytes: little-endian int32 tokens.
      if (bytes % 4 != 0) {
        PyErr_Format(PyExc_ValueError,
                     "tokens: a bytes buffer holds int32 tokens, 4 bytes each; got %zu bytes",
                     bytes);
        return false;
      }
      return Borrow(b.buf, bytes / 4);
    }
    if (format.size() != 1) {
      PyErr_Format(PyExc_TypeError, "tokens: buffer format '%s' is not an integer type", b.format);
      return false;
    }
    const char f = format[0];
    const size_t n = static_cast<size_t>(b.itemsize) > 0 ? bytes / b.itemsize : 0;
    if ((f == 'i' || f == 'l') && b.itemsize == 4) return Borrow(b.buf, n);
    switch (f) {
      case 'b':
        return Convert<int8_t>(b.buf, n);
      case 'h':
        return Convert<int16_t>(b.buf, n);
      case 'i':
      case 'l':
      case 'q':
      case 'n':
        return b.itemsize == 8 ? Convert<int64_t>(b.buf, n) : BadItemSize(b);
      case 'H':
        return Convert<uint16_t>(b.buf, n);
      case 'I':
      case 'L':
      case 'Q':
      case 'N':
        return b.itemsize == 4   ? Convert<uint32_t>(b.buf, n)
               : b.itemsize == 8 ? Convert<uint64_t>(b.buf, n)
                                 : BadItemSize(b);
      default:
        PyErr_Format(PyExc_TypeError, "tokens: buffer format '%s' is not an integer type",
                     b.format);
        return false;
    }
  }

  bool BadItemSize(const Py_buffer& b) {
    PyErr_Format(PyExc_TypeError, "tokens: buffer format '%s' with %zd-byte items is not supported",
                 b.format, b.itemsize);
    return false;
  }

  bool Borrow(const void* p, size_t n) {
    if (reinterpret_cast<uintptr_t>(p) % alignof(int32_t) != 0) {
      owned_.resize(n);
      std::memcpy(owned_.data(), p, n * 4);
      return Own();
    }
    data_ = static_cast<const int32_t*>(p);
    size_ = n;
    return true;
  }

  template <typename T>
  bool Convert(const void* p, size_t n) {
    owned_.resize(n);
    const T* in = static_cast<const T*>(p);
    for (size_t i = 0; i < n; ++i) {
      T v;
      std::memcpy(&v, in + i, sizeof(T));
      if constexpr (std::numeric_limits<T>::is_signed) {
        if (OutOfInt32(static_cast<long long>(v))) return OutOfRange(i, static_cast<long long>(v));
      } else {
        if (v > static_cast<T>(std::numeric_limits<int32_t>::max())) {
          PyErr_Format(PyExc_ValueError, "tokens[%zu] = %llu is outside int32", i,
                       static_cast<unsigned long long>(v));
          return false;
        }
      }
      owned_[i] = static_cast<int32_t>(v);
    }
    return Own();
  }

  bool FromSequence(PyObject* obj) {
    PyObject* seq = PySequence_Fast(obj, "tokens: expected a sequence of ints or an int32 buffer");
    if (seq == nullptr) return false;
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject** items = PySequence_Fast_ITEMS(seq);
    owned_.resize(static_cast<size_t>(n));
    for (Py_ssize_t i = 0; i < n; ++i) {
      PyObject* item = items[i];
      if (!PyLong_Check(item) && !PyIndex_Check(item)) {
        PyErr_Format(PyExc_TypeError, "tokens[%zd]: expected an int, got %s", i,
                     Py_TYPE(item)->tp_name);
        Py_DECREF(seq);
        return false;
      }
      int overflow = 0;
      const long long v = PyLong_AsLongLongAndOverflow(item, &overflow);
      if (v == -1 && PyErr_Occurred()) {
        Py_DECREF(seq);
        return false;
      }
      if (overflow != 0 || OutOfInt32(v)) {
        PyErr_Format(PyExc_ValueError, "tokens[%zd] is outside int32", i);
        Py_DECREF(seq);
        return false;
      }
      owned_[static_cast<size_t>(i)] = static_cast<int32_t>(v);
    }
    Py_DECREF(seq);
    return Own();
  }

  bool OutOfRange(size_t i, long long v) {
    PyErr_Format(PyExc_ValueError, "tokens[%zu] = %lld is outside int32", i, v);
    return false;
  }

  bool Own() {
    data_ = owned_.data();
    size_ = owned_.size();
    return true;
  }

  BufferView view_;
  std::vector<int32_t> owned_;
  const int32_t* data_ = nullptr;
  size_t size_ = 0;
};

PyObject* SipHash128(PyObject*, PyObject* args, PyObject* kwargs) {
  static const char* kwlist[] = {"key", "data", nullptr};
  Py_buffer key_buf, data_buf;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "y*y*:siphash128", const_cast<char**>(kwlist),
                                   &key_buf, &data_buf)) {
    return nullptr;
  }
  core::Hash128 key;
  PyObject* result = nullptr;
  if (Read16(key_buf, "key", &key)) {
    const core::Hash128 h =
        core::SipHash128(key.lo, key.hi,
                         std::string_view(static_cast<const char*>(data_buf.buf),
                                          static_cast<size_t>(data_buf.len)));
    result = BytesOf(h);
  }
  PyBuffer_Release(&key_buf);
  PyBuffer_Release(&data_buf);
  return result;
}

PyObject* NamespaceKey(PyObject*, PyObject* args, PyObject* kwargs) {
  static const char* kwlist[] = {"secret", "tenant", "model", nullptr};
  Py_buffer secret_buf;
  const char* tenant;
  Py_ssize_t tenant_len;
  const char* model;
  Py_ssize_t model_len;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "y*s#s#:namespace_key", const_cast<char**>(kwlist),
                                   &secret_buf, &tenant, &tenant_len, &model, &model_len)) {
    return nullptr;
  }
  core::Hash128 secret;
  PyObject* result = nullptr;
  if (Read16(secret_buf, "secret", &secret)) {
    result =
        BytesOf(core::DeriveNamespaceKey(secret.lo, secret.hi, std::string_view(tenant, tenant_len),
                                         std::string_view(model, model_len)));
  }
  PyBuffer_Release(&secret_buf);
  return result;
}

PyObject* KeyFingerprint(PyObject*, PyObject* args, PyObject* kwargs) {
  static const char* kwlist[] = {"key", nullptr};
  Py_buffer key_buf;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "y*:key_fingerprint", const_cast<char**>(kwlist),
                                   &key_buf)) {
    return nullptr;
  }
  core::Hash128 key;
  PyObject* result = nullptr;
  if (Read16(key_buf, "key", &key)) {
    result = PyLong_FromUnsignedLongLong(core::KeyFingerprint(key.lo, key.hi));
  }
  PyBuffer_Release(&key_buf);
  return result;
}

PyObject* HashPage(PyObject*, PyObject* args, PyObject* kwargs) {
  static const char* kwlist[] = {"key", "prev", "tokens", nullptr};
  Py_buffer key_buf, prev_buf;
  PyObject* tokens_obj;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "y*y*O:hash_page", const_cast<char**>(kwlist),
                                   &key_buf, &prev_buf, &tokens_obj)) {
    return nullptr;
  }
  core::Hash128 key, prev;
  PyObject* result = nullptr;
  Tokens tokens;
  if (Read16(key_buf, "key", &key) && Read16(prev_buf, "prev", &prev) && tokens.Parse(tokens_obj)) {
    result = BytesOf(core::HashPage(key.lo, key.hi, prev, tokens.data(), tokens.size()));
  }
  PyBuffer_Release(&key_buf);
  PyBuffer_Release(&prev_buf);
  return result;
}

PyObject* HashPages(PyObject*, PyObject* args, PyObject* kwargs) {
  static const char* kwlist[] = {"key", "tokens", "page_size", "prev", nullptr};
  Py_buffer key_buf, prev_buf{};
  PyObject* tokens_obj;
  Py_ssize_t page_size;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "y*On|y*:hash_pages", const_cast<char**>(kwlist),
                                   &key_buf, &tokens_obj, &page_size, &prev_buf)) {
    return nullptr;
  }
  const bool has_prev = prev_buf.obj != nullptr;
  core::Hash128 key, prev;
  Tokens tokens;
  std::vector<core::Hash128> hashes;
  bool ok = Read16(key_buf, "key", &key) && (!has_prev || Read16(prev_buf, "prev", &prev));
  if (ok && page_size <= 0) {
    PyErr_Format(PyExc_ValueError, "page_size: must be > 0, got %zd", page_size);
    ok = false;
  }
  ok = ok && tokens.Parse(tokens_obj);
  if (ok) {
    const size_t page = static_cast<size_t>(page_size);
    hashes.resize(tokens.size() / page);
    Py_BEGIN_ALLOW_THREADS;
    core::HashPages(key.lo, key.hi, prev, tokens.data(), tokens.size(), page, hashes.data());
    Py_END_ALLOW_THREADS;
  }
  PyBuffer_Release(&key_buf);
  if (has_prev) PyBuffer_Release(&prev_buf);
  if (!ok) return nullptr;
  PyObject* list = PyList_New(static_cast<Py_ssize_t>(hashes.size()));
  if (list == nullptr) return nullptr;
  for (size_t i = 0; i < hashes.size(); ++i) {
    PyObject* b = BytesOf(hashes[i]);
    if (b == nullptr) {
      Py_DECREF(list);
      return nullptr;
    }
    PyList_SET_ITEM(list, static_cast<Py_ssize_t>(i), b);
  }
  return list;
}

PyMethodDef kMethods[] = {
    {"siphash128", reinterpret_cast<PyCFunction>(SipHash128), METH_VARARGS | METH_KEYWORDS,
     "siphash128(key, data) -> 16 bytes: SipHash-2-4-128, lo then hi little-endian."},
    {"namespace_key", reinterpret_cast<PyCFunction>(NamespaceKey), METH_VARARGS | METH_KEYWORDS,
     "namespace_key(secret, tenant, model) -> the namespace's 16-byte hash key."},
    {"key_fingerprint", reinterpret_cast<PyCFunction>(KeyFingerprint), METH_VARARGS | METH_KEYWORDS,
     "key_fingerprint(key) -> the key's public 64-bit fingerprint."},
    {"hash_page", reinterpret_cast<PyCFunction>(HashPage), METH_VARARGS | METH_KEYWORDS,
     "hash_page(key, prev, tokens) -> hash of one page chained to prev."},
    {"hash_pages", reinterpret_cast<PyCFunction>(HashPages), METH_VARARGS | METH_KEYWORDS,
     "hash_pages(key, tokens, page_size, prev=ZERO_HASH) -> chained hashes of whole pages."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef kModule = {
    PyModuleDef_HEAD_INIT,
    "kvcm._pagehash",
    "The kvcm page hash (common/page_hash_core.h); use it through kvcm.hashing.",
    -1,
    kMethods,
};

}  // namespace

PyMODINIT_FUNC PyInit__pagehash() { return PyModule_Create(&kModule); }
