"""The Streamlit pages. They read through the store and analysis layers, never engine internals."""
