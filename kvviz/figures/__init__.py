"""Pure figure functions: frames and arrays in, plotly figures out. No Streamlit, no database, so
every picture the app shows can be built and checked in a test without a browser."""
